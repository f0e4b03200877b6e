"""Starting jobs: the launch configuration (YAML, ``LaunchConfig``), ``slipstream launch`` on
torch's elastic agent, the worker wrapper every launched process runs, and the notebook and
debug launchers.
"""
