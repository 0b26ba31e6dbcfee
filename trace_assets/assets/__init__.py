"""The Dagster asset layer: one module per pipeline step, imported only by ``definitions`` and tests.

Two beta APIs of the pinned dagster are used here knowingly: ``Output(data_version=...)`` (the
content-hash data versions that staleness rests on) and ``MultiToSingleDimensionPartitionMapping``
(the experiment's seed partitions). Their ``BetaWarning`` is silenced for these modules only, or it
would print in every step's process; elsewhere it still shows.
"""

import warnings

from dagster import BetaWarning

warnings.filterwarnings("ignore", category=BetaWarning, module=r"trace_assets\.assets(\.|$)")
