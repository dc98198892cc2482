"""Front doors for traffic: ``kvcoord route`` (an OpenAI-compatible proxy that places each request by
prefix) and ``kvcoord epp`` (a Gateway API Inference Extension endpoint picker, Envoy ``ext_proc``). Both sit
above the client and the placement policies (:mod:`kvcoord.router`), and share what they know of requests
(:mod:`.requests`), nodes (:mod:`.nodes`) and lookup outages (:mod:`.outage`)."""

from kvcoord.router.policy import POLICY_NAMES

POLICIES = tuple(name for name in POLICY_NAMES if name != "approximate")
"""The policies a front door offers: ``approximate`` needs the prompt's block hashes, which neither
computes (both have the index)."""
