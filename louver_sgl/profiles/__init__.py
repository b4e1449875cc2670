"""Per-device tuned profiles: defaults for index layout, dispatch and kernel launch parameters.

Profiles are written by ``louver-tune export`` and shipped as ``<device key>.json`` beside this
file; the SGLang backend picks the nearest one for its device at startup (``select_profile``):
this device's for the served dtype, this device's for another dtype, else the generic profile of
its ISA (``generic/``, derived from the tuned ones).
"""

from .device import cpu_isa_level, cpu_model_name, device_isa, device_name, normalize_device_name, profile_key
from .format import ACCURACY_KNOBS, DTYPE_DEPENDENT, Profile, ProfileError, Shapes
from .generic import GENERIC_DIR, derive_generic, load_generic
from .select import PROFILE_DIR_ENV, PROFILE_ENV, SHIPPED_DIR, Selection, find_profiles, select_profile

__all__ = [
    "ACCURACY_KNOBS", "DTYPE_DEPENDENT", "GENERIC_DIR", "PROFILE_DIR_ENV", "PROFILE_ENV", "SHIPPED_DIR", "Profile",
    "ProfileError", "Selection", "Shapes", "cpu_isa_level", "cpu_model_name", "derive_generic", "device_isa",
    "device_name", "find_profiles", "load_generic", "normalize_device_name", "profile_key", "select_profile",
]
