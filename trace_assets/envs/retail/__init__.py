"""The built-in ``retail`` target environment: a customer-service domain in the spirit of tau2-bench.

Modules: ``db`` (procedural database), ``tools`` (tools and the rules they enforce), ``policy.md``
(the written policy), ``tasks`` (task families), ``user`` (scripted user), ``expert`` (scripted
demonstrations), ``env`` (``RetailEnv`` / ``RetailEpisode``).
"""

from .env import RetailEnv, RetailEpisode
from .tasks import FAMILIES

__all__ = ["FAMILIES", "RetailEnv", "RetailEpisode"]
