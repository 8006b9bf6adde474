"""How many TPU VM hosts (workers) a Cloud TPU accelerator type has (pure, no gcloud).

The number after the dash counts TensorCores for v2, v3, v4 and v5p and chips for v5e (`v5litepod`) and
v6e (Google Cloud TPU docs, "TPU versions" / "System architecture" pages):

| family | the number counts | per host | hosts of `<family>-N` |
|---|---|---|---|
| v2, v3 | TensorCores (2 per chip) | 4 chips = 8 cores | N / 8 |
| v4, v5p | TensorCores (2 per chip) | 4 chips = 8 cores | N / 8 (v4-16 -> 2, v4-32 -> 4) |
| v5litepod, v6e | chips (1 core each) | 8 chips up to N = 8, 4 chips beyond | 1 for N in 1, 4, 8; N / 4 for 16..256 |

`run` checks the count against `gcloud ... tpu-vm describe` (its `networkEndpoints`) before it starts anything.
"""

from __future__ import annotations

import re

_CORES_PER_HOST_8 = ("v2", "v3", "v4", "v5p")
_CHIPS_SMALL_HOST = ("v5litepod", "v6e")
_PATTERN = re.compile(r"^(v2|v3|v4|v5p|v5litepod|v6e)-(\d+)$")
FAMILIES = _CORES_PER_HOST_8 + _CHIPS_SMALL_HOST


class TopologyError(ValueError):
    """An accelerator type this launcher cannot size (unknown family or a count no slice has)."""


def num_hosts(accelerator_type: str) -> int:
    """Hosts (TPU VM workers) of `accelerator_type`, e.g. `"v4-16"` -> 2, `"v4-32"` -> 4, `"v6e-8"` -> 1.

    Raises TopologyError naming the value and the accepted forms when the type is unknown or its count does
    not fill whole hosts (e.g. `v4-12`).
    """
    m = _PATTERN.match(accelerator_type.strip())
    if not m:
        raise TopologyError(
            f"accelerator type {accelerator_type!r} is not one of <family>-<count> with family in "
            f"{', '.join(FAMILIES)} (e.g. v4-16, v5p-32, v5litepod-16, v6e-8)")
    family, count = m.group(1), int(m.group(2))
    if family in _CORES_PER_HOST_8:
        if count < 8 or count % 8:
            raise TopologyError(
                f"accelerator type {accelerator_type!r}: {family} counts TensorCores, 8 per host; "
                f"use a multiple of 8 (e.g. {family}-8, {family}-16)")
        return count // 8
    if count in (1, 4, 8):
        return 1
    if count < 16 or count & (count - 1):
        raise TopologyError(
            f"accelerator type {accelerator_type!r}: {family} counts chips; slices have 1, 4, 8 or a power of "
            f"two from 16 to 256 (e.g. {family}-16)")
    return count // 4
