"""Ray for `exactrl rl` with ray.enabled: the cluster, the placement groups, the results of actor
calls. It builds no worker (exactrl/workers/groups.py does); Ray is imported only here and
there, when a run asks for it (the ray extra).

Placement (ray.placement):
  colocated: one placement group of max(ranks, engines x engine_tp) bundles; rank i of every
    trainer role (TRAINER_ROLES: policy, reference, critic, reward model, teacher) and rollout
    engine i sit on bundle i, each actor taking an eighth of it (room for all of them at once), as
    OpenRLHF's colocated actors take fractions of one GPU;
  split: a placement group per trainer role (``ranks`` bundles) and one for the rollout engines
    (``engines x engine_tp``), each actor taking a whole bundle.
A bundle is one GPU (and a CPU) when the run's device is CUDA, else one CPU: on CPU the same code
runs, its local cluster declaring as many CPUs as the bundles need (a scheduling count; the actors
run one thread each, OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from exactrl.config.loader import ConfigError

READY_TIMEOUT = 600.0  # seconds for the cluster to grant a placement group (an autoscaler may add nodes)
# The roles that may run as groups of ray.ranks rank actors (reward: reward.model's frozen scorer; teacher:
# distill.teacher's), each in bundles of its own with ray.placement=split.
TRAINER_ROLES = ("policy", "reference", "critic", "reward", "teacher")
# Of a colocated bundle per actor: every trainer role and an engine fit on one. An eighth is exact in Ray's resource
# units (1e-4), where 1/6 is not; a share too small for the roles would leave the last actor waiting for room
# forever, never refused.
SHARE = 0.125
assert (len(TRAINER_ROLES) + 1) * SHARE <= 1


class RoleDied(RuntimeError):
    """An actor of the run (a trainer rank, a rollout engine) died; the run stops, naming it."""


def import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("ray.enabled=true needs Ray: pip install 'exactrl[ray]'") from None
    return ray


@dataclass
class Cluster:
    """The Ray cluster of one run: joined (ray.address) or started here, left at ``close``."""

    owned: bool  # this run connected to it (ray.init), so it disconnects (and a local cluster stops)

    @classmethod
    def connect(cls, address: str, bundles: int) -> Cluster:
        """Connect to ``address`` ('' a local cluster with room for ``bundles`` CPU bundles, 'auto' the running
        one, or HOST:PORT), unless this process is connected already (a test's shared cluster)."""
        ray = import_ray()
        if ray.is_initialized():
            return cls(owned=False)
        if address:
            ray.init(address=address, log_to_driver=True)
        else:  # CPUs as a scheduling count: a 2-core machine still places 4 engines of one thread each
            ray.init(num_cpus=max(os.cpu_count() or 1, bundles + 1), include_dashboard=False, log_to_driver=True)
        return cls(owned=True)

    def gpu(self, device: str) -> bool:
        """Whether the run's bundles are GPUs: distributed.device=cuda, or auto on a cluster that has some."""
        have = import_ray().cluster_resources().get("GPU", 0)
        if device == "cuda" and have < 1:
            raise ConfigError(f"distributed.device=cuda with ray.enabled=true, but the Ray cluster has no GPU "
                              f"({dict(import_ray().cluster_resources())}); start its nodes on GPU machines or set "
                              "distributed.device=cpu")
        return device == "cuda" or (device == "auto" and have >= 1)

    def close(self) -> None:
        if self.owned:
            import_ray().shutdown()


def bundle(gpu: bool, size: int = 1) -> dict[str, float]:
    """One actor's bundle: ``size`` devices (a tensor-parallel engine's), each with a CPU."""
    return {"GPU": float(size), "CPU": float(size)} if gpu else {"CPU": float(size)}


def bundles_needed(placement: str, ranks: int, engines: int, tp: int) -> int:
    """Bundles a run asks for at most (split: every trainer role present)."""
    if placement == "colocated":
        return max(ranks, engines * tp)
    return len(TRAINER_ROLES) * ranks + engines * tp


def reserve(bundles: int, gpu: bool, name: str, size: int = 1):
    """A placement group of ``bundles`` bundles of ``size`` devices, once the cluster grants it; refused
    at once when the cluster could never hold it, and after READY_TIMEOUT when it stays busy."""
    ray = import_ray()
    from ray.util.placement_group import placement_group

    asked = {k: v * bundles for k, v in bundle(gpu, size).items()}
    have = ray.cluster_resources()
    short = {k: f"{v:g} asked, {have.get(k, 0):g} in the cluster" for k, v in asked.items() if have.get(k, 0) < v}
    if short:
        raise ConfigError(f"ray: the {name} bundles need more than the cluster has ({'; '.join(short.values())}); "
                          "lower ray.ranks / ray.engines, use ray.placement=colocated, or add nodes")
    group = placement_group([bundle(gpu, size) for _ in range(bundles)], strategy="PACK", name="")
    try:
        ray.get(group.ready(), timeout=READY_TIMEOUT)
    except ray.exceptions.GetTimeoutError:
        raise RoleDied(f"ray: the cluster did not grant the {name} bundles ({bundles} x {bundle(gpu, size)}) within "
                       f"{READY_TIMEOUT:g}s; other jobs hold its resources") from None
    return group


def actor_options(group, index: int, gpu: bool, share: float, size: int = 1) -> dict:
    """Ray options placing an actor on bundle ``index`` of ``group`` (of ``size`` devices), taking ``share``
    of it: Ray shows the actor (and the processes it starts) the GPUs it takes."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"num_cpus": share * size, "num_gpus": share * size if gpu else 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=group,
                                                                    placement_group_bundle_index=index)}


def failures(refs: Sequence, timeout: float) -> list[str | None]:
    """How each call of ``refs`` failed, in one line (None: it returned), waiting for every one (each at most
    ``timeout`` s): for an error that says what each actor saw, where ``results`` stops at the first failure."""
    ray = import_ray()
    out = []
    for ref in refs:
        try:
            ray.get(ref, timeout=timeout)
            out.append(None)
        except ray.exceptions.RayTaskError as e:
            out.append(str(e.cause).splitlines()[0])
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            out.append(type(e).__name__)
    return out


def results(refs: Sequence, names: Sequence[str], doing: str) -> list:
    """The results of ``refs`` (calls to the actors ``names``), in order; as soon as one fails, its
    exception (an exactrl error raised in the actor is raised here as itself, so a check stops the run
    as it would in one process) or, for an actor that died, RoleDied naming it: a rank blocked in a
    collective with a dead peer is never waited for."""
    ray = import_ray()
    pending, out = dict(zip(refs, range(len(refs)))), [None] * len(refs)
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        i = pending.pop(done[0])
        try:
            out[i] = ray.get(done[0])
        except ray.exceptions.RayActorError as e:
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RoleDied(f"{names[i]} died during {doing} ({why}); the run stops (its actors are ended)") from None
        except ray.exceptions.RayTaskError as e:
            if type(e.cause).__module__.startswith("exactrl."):  # a check, a config or data error: as in one process
                raise e.cause from None
            raise  # anything else is a bug: Ray's error carries the actor's traceback
    return out
