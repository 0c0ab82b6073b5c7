"""switch_model: a software programmable switch that aggregates integer codes on register slots."""
from .pipeline import STAGES, Switch, SwitchConfig  # noqa: F401
