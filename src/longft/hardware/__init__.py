"""The machine (`machine`: what is here) and the policy (`policy`: what every `auto` becomes on it,
with the reason, and which requests it cannot run)."""

from longft.hardware.machine import Hardware, detect
from longft.hardware.policy import LIGER_FAMILIES, TILED_MLP_FROM, Choice, PlanError, resolve

__all__ = ["Hardware", "detect", "Choice", "PlanError", "resolve", "LIGER_FAMILIES", "TILED_MLP_FROM"]
