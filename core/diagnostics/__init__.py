"""Knowing what the job is doing: hang reports that name the process that is behind
(:mod:`.hang`, :mod:`.hang_report`, :mod:`.flight_recorder`, :mod:`.stacks`) and model FLOP
counts and device peaks for MFU (:mod:`.flops`). The monitors built on them, and the
bad-step guard, are callbacks (:mod:`slipstream.callbacks`); see docs/misbehaving.md."""
