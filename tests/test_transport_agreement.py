"""One transport decision for the whole job: every rank describes what it can run, all ranks
apply one rule to the same list (simulated mixes of vendors and GPU generations on gloo ranks),
and ROCm's "nccl" is recognised as RCCL."""
from __future__ import annotations

import pytest

from ep_comm.transports.select import RankCapabilities, decide_transport, gather_capabilities

H100 = RankCapabilities("nvidia", "90", ("90",), True, "nccl")
B200 = RankCapabilities("nvidia", "100", ("90",), True, "nccl")
MI300 = RankCapabilities("amd", "gfx942", (), False, "nccl")
NO_NVSHMEM = RankCapabilities("nvidia", "90", ("90",), False, "nccl")
CPU = RankCapabilities("cpu", "", (), False, "gloo")


def test_nvshmem_only_when_every_rank_can_run_it():
    assert decide_transport("auto", [H100] * 4)[0] == "nvshmem"
    choice, why = decide_transport("auto", [H100, H100, B200, H100])
    assert choice == "torch" and "rank 2: sm_100" in why
    choice, why = decide_transport("auto", [H100, MI300])
    assert choice == "torch" and "mixed job: amd, nvidia" in why and "rank 1: an AMD GPU (gfx942)" in why
    choice, why = decide_transport("auto", [H100, NO_NVSHMEM])
    assert choice == "torch" and "rank 1" in why and "NVSHMEM" in why


def test_forcing_nvshmem_on_a_job_that_cannot_run_it_names_the_ranks():
    with pytest.raises(ValueError, match=r"rank 1: no CUDA GPU"):
        decide_transport("nvshmem", [H100, CPU])


def test_rocm_reports_nccl_but_it_is_rccl():
    assert MI300.collective_backend == "rccl" and H100.collective_backend == "nccl"


def _agree(rank, world, group, kinds):
    mine = {"h100": H100, "b200": B200, "mi300": MI300}[kinds[rank]]
    return decide_transport("auto", gather_capabilities(group, mine))


@pytest.mark.parametrize("kinds", [("h100", "h100", "b200", "h100"), ("mi300", "h100"), ("h100", "h100")])
def test_every_rank_takes_the_same_decision(ranks, kinds):
    results = ranks(len(kinds), _agree, kinds)
    assert len({choice for choice, _ in results}) == 1 and len({why for _, why in results}) == 1
    assert results[0][0] == ("nvshmem" if set(kinds) == {"h100"} else "torch")
