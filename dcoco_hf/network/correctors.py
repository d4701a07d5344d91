"""The correctors a drafter can carry, by `DCOCOConfig.corrector_type`: the one place that reads the name.

Each corrector is a `Corrector` (corrector.py): it builds itself from the config, lays out its own pair inputs and
scores a block's candidates; the drafter, the configuration and training ask it through that interface only.
"""

from __future__ import annotations

from .corrector import Corrector, DCOCOCorrector
from .lilicorr import LiLiCorrCorrector
from .selector import SelectorCorrector

CORRECTORS: dict[str, type[Corrector]] = {
    "dcoco": DCOCOCorrector, "lilicorr": LiLiCorrCorrector, "dflash2": SelectorCorrector,
}
CORRECTOR_TYPES = tuple(CORRECTORS)


def corrector_class(corrector_type: str) -> type[Corrector]:
    """The class registered as `corrector_type`; a ValueError naming the choices for any other name."""
    try:
        return CORRECTORS[corrector_type]
    except (KeyError, TypeError):
        raise ValueError(f"corrector_type={corrector_type!r} is unknown; choose one of {CORRECTOR_TYPES}.") from None
