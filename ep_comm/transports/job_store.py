"""The job's key-value store as ep_comm's failure handling uses it: which store, what to say when
it is gone, and the rejoin handshake of a restarted process.

Naming a dead peer, re-forming a group of the live ranks (``mask_ranks``, ``unmask_ranks``,
``reset``) and letting a restarted process back in all go through one ``torch.distributed`` store.
That store must outlive the rank that died: a ``TCPStore`` hosted outside the workers (by the
launcher or a sidecar process) and passed to ``init_process_group(store=...)`` or
``Buffer(store=...)`` does, while ``init_method="tcp://..."`` or ``"env://"`` outside torchrun
host it in global rank 0's worker, so rank 0's death takes it along. torchrun's elastic agent
hosts the store outside the workers too, but the agent itself stops the other workers of its node
when one fails (and restarts them all if ``--max-restarts`` allows): under torchrun a death is
recovered by that restart, not by masking.

Rejoin handshake (keys under ``ep_comm/rejoin/<global rank>/``):

1. the restarted process (``Buffer.rejoin``) sets ``waiting`` and waits for ``invite``;
2. the survivors see it in ``Buffer.rejoining_ranks()`` (collective, so all see the same list);
3. their ``unmask_ranks`` writes ``invite`` (the Buffer's description: its name in the store, the
   name of the group about to be formed, the live ranks, its construction arguments), written by
   the lowest surviving rank, and forms the group of the live ranks, the newcomer included;
4. the newcomer takes ``invite`` (deletes it, so a second Buffer's invite is never mistaken for
   this one), clears ``waiting`` and forms the same group. The inviter deletes ``invite`` after
   its formation either way, so a late newcomer never reads a stale one.
"""
from __future__ import annotations

import json
import time
from datetime import timedelta

import torch.distributed as dist

from ..errors import CommTimeoutError, StoreLostError

SURVIVING_LAUNCHES = ("host a TCPStore outside the workers (in the launcher or a sidecar process) and pass it to "
                      "init_process_group(store=...) or Buffer(store=...), with a launcher that keeps the other "
                      "workers running when one dies (torchrun's agent stops them and restarts the job instead)")


def resolve_store(store: dist.Store | None) -> dist.Store:
    """``store`` when given; else the store the default process group was launched with (its
    ``PrefixStore`` wrappers removed, so a restarted process that connects a plain client to the
    same server meets the same keys).

    Raises:
        ValueError: no store given and no default process group.
    """
    if store is not None:
        if not isinstance(store, dist.Store):
            raise ValueError(f"store must be a torch.distributed.Store, got {type(store).__name__}")
        return store
    if not dist.is_initialized():
        raise ValueError("store: no default process group to take the store from; pass store=...")
    root = dist.distributed_c10d._get_default_store()
    while isinstance(root, dist.PrefixStore):
        root = root.underlying_store
    return root


def store_alive(store: dist.Store) -> bool:
    """Whether the store answers (a round trip to its server)."""
    try:
        store.check(["ep_comm/alive"])
    except Exception:  # noqa: BLE001 - any failure means no usable store
        return False
    return True


def store_lost(phase: str, cause: BaseException | None = None) -> StoreLostError:
    """The error for a store that stopped answering, saying which launches survive that."""
    after = f" (after {type(cause).__name__}: {str(cause).splitlines()[0][:160]})" if cause is not None else ""
    return StoreLostError(
        f"ep_comm {phase}: the job's key-value store no longer answers{after}. With init_method 'tcp://' or "
        f"'env://' outside torchrun the store lives in global rank 0's process, so rank 0 has most likely died; "
        f"without a store no peer can be named, masked or re-formed. To survive rank 0's death, "
        f"{SURVIVING_LAUNCHES}.", peers=[], phase=phase)


def _keys(global_rank: int) -> tuple[str, str]:
    prefix = f"ep_comm/rejoin/{global_rank}/"
    return prefix + "waiting", prefix + "invite"


def waiting(store: dist.Store, global_ranks: list[int]) -> list[int]:
    """Which of ``global_ranks`` have a restarted process waiting in ``Buffer.rejoin``.

    Raises:
        StoreLostError: the store does not answer.
    """
    try:
        return [g for g in global_ranks if store.check([_keys(g)[0]])]
    except Exception as error:  # noqa: BLE001 - the store's server is gone
        raise store_lost("rejoining_ranks", error) from error


def invite(store: dist.Store, global_rank: int, description: dict) -> None:
    """Step 3 of the handshake: tells the newcomer of ``global_rank`` what it joins."""
    try:
        store.set(_keys(global_rank)[1], json.dumps(description))
    except Exception as error:  # noqa: BLE001 - the store's server is gone
        raise store_lost("unmask_ranks", error) from error


def withdraw(store: dist.Store, global_rank: int) -> None:
    """Removes an invite the newcomer did not take (its formation is over either way)."""
    try:
        store.delete_key(_keys(global_rank)[1])
    except Exception:  # noqa: BLE001 - a lost store shows in the formation's own error
        return


def accept(store: dist.Store, global_rank: int, timeout_s: float) -> dict:
    """Steps 1 and 4 on the newcomer: announces it, waits up to ``timeout_s`` for an invite and
    takes it.

    Raises:
        CommTimeoutError: no invite within ``timeout_s``. StoreLostError: the store is gone.
    """
    wait_key, invite_key = _keys(global_rank)
    started = time.monotonic()
    try:
        store.set(wait_key, str(time.time()))
        try:
            while True:
                try:
                    store.wait([invite_key], timedelta(seconds=max(timeout_s - (time.monotonic() - started), 0.01)))
                except dist.DistStoreError as error:
                    if "timeout" not in str(error).lower() and "timed out" not in str(error).lower():
                        raise
                    raise CommTimeoutError(
                        f"ep_comm rejoin: no live Buffer invited global rank {global_rank} within "
                        f"timeout_s={timeout_s:g}; the survivors call rejoining_ranks() and unmask_ranks(...) "
                        f"with it", peers=[], phase="rejoin") from error
                text = store.get(invite_key)
                if store.delete_key(invite_key):  # taken by this call, not by an earlier one
                    return json.loads(text)
        finally:
            store.delete_key(wait_key)
    except (CommTimeoutError, ValueError):
        raise
    except Exception as error:  # noqa: BLE001 - the store's server is gone
        if store_alive(store):
            raise
        raise store_lost("rejoin", error) from error


def arrive(store: dist.Store, name: str, global_ranks: list[int], rank: int, timeout_s: float, phase: str) -> None:
    """Waits up to ``timeout_s`` until every rank of a group has reached the same point, the
    group's next round under ``name`` (a name the group's ranks share, e.g. its process group's):
    each rank counts itself in (``store.add``: round ``(count - 1) // len(global_ranks)``, since no
    rank counts itself into a round before every rank has arrived in the one before), sets its
    key of the round and waits for the others'. For a collective step whose own wait no timeout
    bounds (``torch.distributed``'s object collectives wait for the group's timeout, 30 minutes by
    default).

    Raises:
        CommTimeoutError: a rank did not arrive within ``timeout_s``; ``peers`` names it (ranks of
            the group, ``rank`` being this one's). StoreLostError: the store does not answer.
    """
    size = len(global_ranks)
    prefix = f"ep_comm/arrive/{name}/"
    started = time.monotonic()
    try:
        count = int(store.add(prefix + "count", 1))
        keys = [f"{prefix}{(count - 1) // size}/{g}" for g in global_ranks]
        store.set(keys[rank], "1")
        try:
            store.wait(keys, timedelta(seconds=max(timeout_s, 0.01)))
            return
        except dist.DistStoreError as error:
            if "timeout" not in str(error).lower() and "timed out" not in str(error).lower():
                raise
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
    except Exception as error:  # noqa: BLE001 - the store's server is gone
        if store_alive(store):
            raise
        raise store_lost(phase, error) from error
    raise CommTimeoutError(
        f"ep_comm {phase}: rank {rank} waited {time.monotonic() - started:.1f}s; rank(s) {missing} did not "
        f"arrive within timeout_s={timeout_s:g}", peers=missing, phase=phase)
