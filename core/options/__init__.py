"""What users pass in: kwargs handlers (Accelerate's dataclasses), the choices they name, and
:class:`ConfigError`, the base error for configuration a user must change.
"""
