"""Step caching (``cache=``): on some denoising steps, run only the DiT's first blocks and reuse the residual
the remaining blocks added at the last step that ran them (docs/CACHE.md).

``policies.py`` decides which steps compute (a registry: ``none``, ``first_block``, ``static``);
``forward.py`` runs the model in its two parts and keeps the residuals, one state per CFG branch. Neither
imports ``torch.distributed``: a layout passes in the sum over its SP group (``Layout.sp_sum``), so the
ranks that share a forward take one decision.
"""

from ditrun.cache.forward import StepCache, make_step_cache
from ditrun.cache.policies import CACHE_POLICIES, check_config

__all__ = ["CACHE_POLICIES", "StepCache", "check_config", "make_step_cache"]
