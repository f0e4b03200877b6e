"""What every process runs on: the process state and its environment (the only reader of
``os.environ``), collectives and their checks, synchronisation, RNG, preemption signals and
the helpers that walk nested tensors. Nothing here knows about models or strategies.
"""
