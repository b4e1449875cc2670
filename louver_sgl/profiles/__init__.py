"""Per-device tuned profiles: defaults for index layout, dispatch and kernel launch parameters.

Profiles are written by ``louver-tune export`` and shipped as ``<device key>.json`` beside this
file; the SGLang backend picks the one for its device at startup (``select_profile``).
"""

from .device import cpu_isa_level, cpu_model_name, device_name, normalize_device_name, profile_key
from .format import ACCURACY_KNOBS, Profile, ProfileError, Shapes
from .select import PROFILE_DIR_ENV, PROFILE_ENV, SHIPPED_DIR, Selection, find_profiles, select_profile

__all__ = [
    "ACCURACY_KNOBS", "PROFILE_DIR_ENV", "PROFILE_ENV", "SHIPPED_DIR", "Profile", "ProfileError",
    "Selection", "Shapes", "cpu_isa_level", "cpu_model_name", "device_name", "find_profiles",
    "normalize_device_name", "profile_key", "select_profile",
]
