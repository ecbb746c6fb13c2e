"""Asynchronous rollout pool: servers generate continuously while the trainer steps.

Every prompt group belongs to a batch ``b`` (the trainer consumes batch ``b`` at trainer version
``b``: one optimizer step per batch). Staleness control is admission control, one rule for
every mode (AReaL, Fu et al., arXiv 2505.24298, Sec. 5.1): a group of batch ``b`` may start only
once the servers hold version ``>= b - lag``. With FIFO consumption by batch index, a sample's
age (trainer version minus the oldest version that produced one of its tokens, see
:func:`~megatron_sat.rollout.types.staleness`) is then at most ``lag``.

- ``fixed_lag`` (the SAT paper's configured lag n): in addition the trainer does not push
  version ``v`` until every batch ``b <= v - 1 + lag`` has finished, so each batch is generated
  by exactly version ``b - lag`` and every sample's age equals ``lag`` after warm-up
  (batches ``b < lag`` come from version 0).
- ``bounded`` (maximum staleness eta = ``lag``): weight pushes never wait; requests in flight
  during a push are either resumed from their partial output (each token keeps the version that
  produced it) or restarted from the prompt (``on_update``).

Bounded mode runs on the wall clock by default: where a push cuts a request, and which version
starts which request, depend on how fast the trainer and the servers are, so two runs with the
same seed differ. With ``clock_tokens`` = K > 0 it runs on a logical clock instead, and a run
repeats bit for bit (and resumes exactly from a checkpoint). Generation advances in *rounds*:
every queued request (all admitted work: at most ``lag + 1`` batches, split in order over the
live servers) generates up to K tokens, in one batched request per server, and the servers'
answers are taken in server order once all have answered. At version ``v`` the servers run rounds
until batch ``v`` (the one the trainer consumes next) is complete, then one more round (the
generation that overlaps the trainer's step), then wait: a push lands between rounds
(``wait_before_update`` waits for that pause), never inside one. A request cut by the end of a
round continues in a later one, at whatever version then holds (``on_update``), so a sample's
tokens can still span versions and its age ranges from 0 to ``lag``; the cut points are
functions of K, the seeds and the batch shapes only. K stands for how fast the servers are
against the trainer: the larger, the further ahead they get (at K = ``max_new_tokens`` the
servers finish every admitted batch while the trainer steps, and samples reach the bound).
Every request carries its own ``sampling_seed`` (``seed_of``), so a request's draws do not
depend on which round, server or attempt generated them. The only server dying in a round
while the trainer waits for its batch is exact: the round is redone by the restarted server,
at the same version. Not exact: a server dying while others live (its requests go to the
others, whose batches then differ), and one dying in the overlap round, while the trainer
steps: the trainer has moved on, so the restarted server gets the next version's weights and
the round's lost work is done at that version.

Resilience: a request whose server fails (connection error, timeout, HTTP error) is re-issued on
another live server; the failed server is marked dead and reported (``stats.dead_servers``,
``down_servers()``). A group is delivered once, when all its samples are complete. Every job is
owned by exactly one worker between leaving the queue and being delivered or re-queued, which
is what makes delivery exactly-once across failures and restarts. The pool does not restart
servers itself: the owner of the servers (``rollout.fleet.RolloutFleet``) restarts a dead
embedded server, pushes it the current weights and version, and only then hands the fresh
client to ``replace_server``, which starts the slot's new worker; until then nothing is sent to
that slot. Each slot's worker carries a generation number, so a worker left over from the old
server (idle, or with a request in flight that then fails) retires without touching the new one.
When no live server remains, ``get_batch`` and ``wait_before_update`` raise
:class:`~megatron_sat.rollout.pool.NoLiveServer` with every unfinished job still queued; they can
be called again after ``replace_server``.

Per-server request accounting (utilisation, samples and tokens per server index) goes to
``meter`` (:class:`~megatron_sat.rollout.meter.ServerMeter`).
"""

from megatron_sat.rollout.async_pool.config import MODES, ON_UPDATE, AsyncPoolConfig
from megatron_sat.rollout.async_pool.core import PoolStats
from megatron_sat.rollout.async_pool.pool import AsyncRolloutPool
from megatron_sat.rollout.async_pool.state import check_pool_state

__all__ = [
    "MODES",
    "ON_UPDATE",
    "AsyncPoolConfig",
    "AsyncRolloutPool",
    "PoolStats",
    "check_pool_state",
]
