"""Every model family the engine serves, by the architecture names in ``config.json``."""

from __future__ import annotations

from engine.models.family import Family
from engine.models.gemma import GEMMA2, GEMMA3
from engine.models.granite import GRANITE
from engine.models.llama import LLAMA, MISTRAL, QWEN2
from engine.models.mixtral import MIXTRAL
from engine.models.olmo2 import OLMO2
from engine.models.phi3 import PHI3
from engine.models.qwen3 import QWEN3, QWEN3_MOE
from engine.models.smollm3 import SMOLLM3

FAMILIES: tuple[Family, ...] = (
    LLAMA,
    MISTRAL,
    QWEN2,
    QWEN3,
    QWEN3_MOE,
    MIXTRAL,
    GEMMA2,
    GEMMA3,
    PHI3,
    OLMO2,
    GRANITE,
    SMOLLM3,
)
_BY_ARCH = {arch: family for family in FAMILIES for arch in family.architectures}
SUPPORTED_ARCHITECTURES = tuple(_BY_ARCH)


def family_for(architectures: list[str], model_type: str | None = None) -> tuple[Family, str]:
    """The family of the first architecture served; ValueError naming what is served otherwise."""
    for arch in architectures:
        if arch in _BY_ARCH:
            return _BY_ARCH[arch], arch
    raise ValueError(
        f"unsupported architecture {architectures or model_type!r}; "
        f"inflight serves {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def family_of(architecture: str) -> Family:
    return _BY_ARCH[architecture]
