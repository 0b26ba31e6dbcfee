"""TRACE Step 4 (Route): pick (or mix) a capability adapter per task, training-free.

* :mod:`.router`: the paper's label-logit router (the frozen base reads the task and one labelled
  option per capability plus "base"; the largest label-token logit wins).
* :mod:`.retrieval`: retrieval (nearest centroid / k-NN over labelled first user prompts) and hybrid
  (retrieval shortlist + label-logit choice) routers, for models too small to read the router prompt.
* :mod:`.compose`: applying decisions: an :class:`AdapterBank` of unmerged LoRA adapters on one base,
  bit-exact merge/restore, exact soft composition, and routed rollouts.
* :mod:`.report`: accuracy, confusion, the hindsight oracle, attribution, tables and plots.

Every router returns :class:`Decision` (``choice=None`` means the base model).
"""

from trace_assets.route.router import (
    ANSWER_PREFIX,
    BASE,
    BASE_NAME,
    LABELS,
    Decision,
    LogitRouter,
    RouterCandidate,
    build_router_prompt,
    choose_example,
    example_text,
    first_user_prompt,
    label_token_ids,
    router_chat_text,
    router_labels,
)

__all__ = [
    "ANSWER_PREFIX", "BASE", "BASE_NAME", "LABELS", "Decision", "LogitRouter", "RouterCandidate",
    "build_router_prompt", "choose_example", "example_text", "first_user_prompt", "label_token_ids", "router_chat_text",
    "router_labels",
]
