"""``deep_ep.buffers.elastic``: DeepEP 2.x's ``ElasticBuffer`` and ``EPHandle`` (see
:mod:`ep_comm.integrations.deep_ep_elastic` for what is offered and how)."""
from ep_comm.integrations.deep_ep_elastic import ElasticBuffer, EPHandle

__all__ = ["EPHandle", "ElasticBuffer"]
