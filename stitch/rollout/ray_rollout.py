"""Ray-placed GRPO rollouts: ``RolloutWorker`` actors in a placement group, refit by a collective broadcast.

``stages.grpo.placement: ray`` swaps the colocated engine for :class:`RayRolloutEngine`, which has the same
``generate`` / ``refit`` interface. It reserves one placement-group bundle for the policy (this process: it
embeds the prompts, scores and trains) and one per rollout replica (``parallel.rollout_replicas``; a GPU each
where the cluster has GPUs, else CPU bundles). Each worker builds its own engine, ``embedded`` or ``vllm`` as
the recipe's ``engine`` says, from the base model snapshot the policy was loaded from (``embedded``: the model
plugin's loader on the same registered model and local snapshot, checked by fingerprint; ``vllm``: the policy's
text config) plus the policy's *merged* weights (LoRA folded in by :func:`merged_state_dict`): no adapter object
ever reaches an engine.

Sampling is seeded per call: ``generate(..., seed=s)`` makes replica ``r`` sample from ``sampling_seed(s, r)``,
so a step's rollouts depend on the step's seed alone, not on what the worker generated before (a worker's RNG
is in no checkpoint, so a resumed run could not replay it otherwise).

Weights travel by a collective broadcast, not through Ray's object store: the policy process (rank 0) and
the workers (ranks 1..N) form one ``torch.distributed`` process group (gloo on CPU, nccl when policy and
workers are on GPUs) that rendezvouses through a TCP store whose address the driver hands to the actors. The
group is a standalone ``ProcessGroup`` object, so it leaves the process's default group (torchrun, FSDP)
alone. A refit sends the whole merged state dict (vLLM stacks q/k/v and gate/up, so a partial layer would be
loaded silently as garbage), packed into byte buckets; the names, shapes and dtypes go first through Ray.
The payload is validated before the broadcast starts (a refused payload raises here and no worker waits on
a collective), and again by each worker before it touches its engine.

Prompts (already-projected embeddings from ``stitch.rollout.prompts.prompt_embeddings``) are split into contiguous chunks across the replicas; completions,
with the engine's own log-probs, come back in prompt order, so GRPO's policy/engine parity report is unchanged.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from stitch.config.recipe import Recipe
from stitch.kernels.cpu_math import settle_cpu_math
from stitch.model.loading import load_model, source_fingerprint, with_local_snapshot
from stitch.plugins.registry import Registry, SpecTable
from stitch.rollout.engines import Completion, sampling_seed
from stitch.rollout.vllm_engine import RefitError, VLLMEngine, merged_state_dict, write_engine_config

BUCKET_BYTES = 256 << 20  # one broadcast carries at most this much (a larger single tensor goes alone)
_ALIGN = 64  # byte offset of every tensor inside a bucket, so views of any dtype are aligned
_FORWARDED_ENV = ("STITCH_", "HF_", "TRANSFORMERS_")  # the workers find caches and snapshots like the driver

Manifest = list[tuple[str, tuple[int, ...], str]]  # (name, shape, dtype) in broadcast order


# -- payload ----------------------------------------------------------------------------------------------


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise RefitError(f"unknown dtype {name!r} in a refit manifest")
    return dtype


def dominant_dtype(tensors: Mapping[str, torch.Tensor] | torch.nn.Module) -> torch.dtype:
    values = tensors.parameters() if isinstance(tensors, torch.nn.Module) else tensors.values()
    floating = [t.dtype for t in values if t.is_floating_point()]
    if not floating:
        raise RefitError("no floating-point weights")
    return max(set(floating), key=floating.count)


def validate_payload(expected: Mapping[str, tuple[int, ...]], dtype: torch.dtype,
                     state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The checks :meth:`VLLMEngine.validate` makes (whole state dict by name and shape, no meta tensors, finite
    values), against ``expected``; returns the payload with floating tensors in ``dtype``."""
    return VLLMEngine.validate(SimpleNamespace(expected=dict(expected), dtype=dtype), state_dict)


def manifest_of(state_dict: Mapping[str, torch.Tensor]) -> Manifest:
    return [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in state_dict.items()]


def plan_buckets(manifest: Manifest, bucket_bytes: int = BUCKET_BYTES) -> list[tuple[int, list[tuple[int, int, int]]]]:
    """Broadcast buckets: ``(total_bytes, [(manifest index, byte offset, byte count), ...])``, computed the same
    way on both ends from the manifest alone."""
    buckets: list[tuple[int, list[tuple[int, int, int]]]] = []
    entries: list[tuple[int, int, int]] = []
    size = 0
    for index, (_, shape, dtype) in enumerate(manifest):
        numel = 1
        for dim in shape:
            numel *= dim
        nbytes = numel * _dtype(dtype).itemsize
        offset = -(-size // _ALIGN) * _ALIGN
        if entries and offset + nbytes > bucket_bytes:
            buckets.append((size, entries))
            entries, offset = [], 0
        entries.append((index, offset, nbytes))
        size = offset + nbytes
    if entries:
        buckets.append((size, entries))
    return buckets


def broadcast_state_dict(group: Any, state_dict: Mapping[str, torch.Tensor], manifest: Manifest,
                         device: torch.device, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Rank 0's side: pack each bucket's tensors as bytes and broadcast it."""
    for total, entries in plan_buckets(manifest, bucket_bytes):
        buf = torch.empty(total, dtype=torch.uint8, device=device)
        for index, offset, nbytes in entries:
            tensor = state_dict[manifest[index][0]].detach().to(device).contiguous().reshape(-1)
            buf[offset:offset + nbytes].copy_(tensor.view(torch.uint8))
        group.broadcast(buf, 0).wait()


def receive_state_dict(group: Any, manifest: Manifest, device: torch.device,
                       bucket_bytes: int = BUCKET_BYTES) -> dict[str, torch.Tensor]:
    """A receiving rank's side: the state dict, as views into the received buckets."""
    out: dict[str, torch.Tensor] = {}
    for total, entries in plan_buckets(manifest, bucket_bytes):
        buf = torch.empty(total, dtype=torch.uint8, device=device)
        group.broadcast(buf, 0).wait()
        for index, offset, nbytes in entries:
            name, shape, dtype = manifest[index]
            out[name] = buf[offset:offset + nbytes].view(_dtype(dtype)).reshape(shape)
    return out


def new_group(store: Any, rank: int, world_size: int, backend: str, timeout: datetime.timedelta) -> Any:
    """A standalone process group over ``store`` (the process's default group, if any, is not touched)."""
    store = dist.PrefixStore("stitch-refit", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    if backend != "gloo":
        raise ValueError(f"refit backend {backend!r}: expected gloo or nccl")
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def _close_group(group: Any) -> None:
    for method in ("shutdown", "abort"):
        fn = getattr(group, method, None)
        if fn is not None:
            try:
                fn()
                return
            except Exception:  # noqa: BLE001 - best effort at teardown
                continue


# -- the worker (a Ray actor) -----------------------------------------------------------------------------


def worker_specs(registry: Registry, engine: str, model: str) -> SpecTable:
    """What a rollout worker looks up, picked from ``registry`` in the policy's process: the model and its
    state-dict adapter (an engine on a transformers LM loads the base), the engine (vLLM is built by the worker's
    own ``VLLMEngine``)."""
    if engine == "vllm":
        return SpecTable()
    spec = registry.get("models", model)
    wanted = [("models", model), ("rollout_engines", engine)]
    if spec.state_dict_adapter is not None:
        wanted.append(("state_dict_adapters", spec.state_dict_adapter))
    return SpecTable.pick(registry, wanted)


class RolloutWorker:
    """One rollout replica: its own engine on merged weights, fed by the policy's broadcasts.

    Started as a Ray actor by :class:`RayRolloutEngine` (``ray.remote(RolloutWorker)``); rank ``rank`` in the
    refit group. The engine is built on the first broadcast (the initial weights) and refit on every later one.
    """

    def __init__(self, rank: int, *, engine: str, model: str, specs: SpecTable, dtype: str, pad_id: int,
                 eos_id: int | None, suppress_ids: Sequence[int], engine_config: dict[str, Any] | None,
                 vocab_size: int | None, env: Mapping[str, str], seed: int,
                 engine_options: Mapping[str, Any] | None = None, snapshot: str | None = None) -> None:
        os.environ.update(env)
        settle_cpu_math()  # a worker process of its own: its first rollout's CPU math as exact as later ones
        self.rank = rank
        self.engine_name = engine
        self.model_name = model
        self.specs = specs  # the model, engine and state-dict adapter specs, shipped: no plugin host here
        self.dtype = _dtype(dtype)
        self.pad_id, self.eos_id, self.suppress_ids = pad_id, eos_id, list(suppress_ids)
        self.engine_config, self.vocab_size = engine_config, vocab_size
        self.engine_options = dict(engine_options or {})
        self.gpu_ids = self._gpu_ids()
        self.device = torch.device("cuda:0" if self.gpu_ids and torch.cuda.is_available() else "cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(sampling_seed(seed, rank))  # for calls without a seed
        self.engine: Any = None
        self.group: Any = None
        self.lm: Any = None
        self.expected: dict[str, tuple[int, ...]] | None = None
        self.base_fingerprint: str | None = None
        if engine != "vllm":  # an engine on a transformers LM: the policy's base snapshot, through the model plugin
            spec = specs.get("models", model)
            if snapshot is not None:  # the recipe's model.snapshot, as the policy read it (refused here if absent)
                spec = with_local_snapshot(spec, snapshot)
            self.base_fingerprint = source_fingerprint(spec.source)
            self.lm = load_model(spec, dtype=self.dtype, registry=specs).to(self.device).eval()
            self.lm.requires_grad_(False)
            self.expected = {n: tuple(t.shape) for n, t in self.lm.state_dict().items()}

    @staticmethod
    def _gpu_ids() -> list[str]:
        try:
            import ray  # optional: ray ([ray] extra)

            if not ray.is_initialized():  # outside an actor ray.get_gpu_ids() would start a local cluster
                return []
            return [str(i) for i in ray.get_gpu_ids()]
        except Exception:  # noqa: BLE001 - outside Ray (a direct construction in a test)
            return []

    def describe(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": os.getpid(), "device": str(self.device), "gpu_ids": self.gpu_ids,
                "expected": self.expected, "base_fingerprint": self.base_fingerprint}

    def join(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> int:
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        self.group = new_group(store, self.rank, world_size, backend, timeout)
        # gloo moves host memory; the engine copies the received weights onto its device
        self.comm_device = self.device if backend == "nccl" else torch.device("cpu")
        return self.rank

    def receive(self, manifest: Manifest, bucket_bytes: int = BUCKET_BYTES) -> int:
        """Take part in one broadcast; build the engine (first time) or refit it. Returns the weights loaded."""
        if self.group is None:
            raise RuntimeError(f"rollout worker {self.rank} has not joined the refit group")
        payload = receive_state_dict(self.group, manifest, self.comm_device, bucket_bytes)
        if self.engine_name == "vllm":
            if self.engine is None:
                self.engine = self._build_vllm(payload)
            else:
                self.engine.refit(payload)  # VLLMEngine.refit validates the whole payload first
            return len(payload)
        payload = validate_payload(self.expected, self.dtype, payload)
        self.lm.load_state_dict(payload, strict=True)
        if self.engine is None:
            factory = self.specs.get("rollout_engines", self.engine_name).factory
            self.engine = factory(self.lm, pad_id=self.pad_id, eos_id=self.eos_id, suppress_ids=self.suppress_ids)
        else:
            self.engine.refit(payload)  # the embedded engine's is a no-op: it generates with self.lm
        return len(payload)

    def _build_vllm(self, payload: dict[str, torch.Tensor]) -> Any:
        self._config_dir = tempfile.TemporaryDirectory(prefix="stitch-ray-vllm-")
        (Path(self._config_dir.name) / "config.json").write_text(json.dumps(self.engine_config))
        return VLLMEngine(self._config_dir.name, payload, pad_id=self.pad_id, eos_id=self.eos_id,
                          suppress_ids=self.suppress_ids, vocab_size=self.vocab_size, dtype=self.dtype,
                          **self.engine_options)

    def generate(self, prompt_embeds: list[torch.Tensor], n: int, max_new_tokens: int, temperature: float = 1.0,
                 greedy: bool = False, seed: int | None = None) -> list[Completion]:
        """``seed``: this call's sampling seed (GRPO's per-step seed); the replica samples from
        ``sampling_seed(seed, rank)``, so replicas differ and a call does not depend on earlier ones. None: from
        the worker's own RNG, seeded once at start (what it draws then depends on the calls before)."""
        if self.engine is None:
            raise RuntimeError(f"rollout worker {self.rank} has no weights yet")
        prompts = [e.to(self.device) for e in prompt_embeds]
        return self.engine.generate(prompts, n, max_new_tokens, temperature, greedy=greedy,
                                    seed=None if seed is None else sampling_seed(seed, self.rank))

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None and hasattr(engine, "close"):
            engine.close()
        group, self.group = self.group, None
        if group is not None:
            _close_group(group)


# -- the driver side --------------------------------------------------------------------------------------


def check_worker_bases(infos: Sequence[Mapping[str, Any]], model: str, snapshot: Path | str | None,
                       fingerprint: str | None) -> None:
    """Refuse workers whose base LM is not the policy's: a worker that loaded one (``embedded``) must report the
    policy's base fingerprint (a snapshot path that holds other files on another node, a preset built otherwise)."""
    if fingerprint is None:
        return
    for info in infos:
        got = info.get("base_fingerprint")
        if got is not None and got != fingerprint:
            where = f"the local snapshot {str(snapshot)!r}" if snapshot is not None else "its registered source"
            raise RefitError(f"rollout worker {info['rank']} loaded model {model!r} from {where} with fingerprint "
                             f"{got[:16]}..., but the policy's base has {fingerprint[:16]}...; every worker must read "
                             f"the same snapshot the policy trains on (same files on every node)")



def _physical_gpu() -> str | None:
    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[index].strip() if visible else str(index)


class RayRolloutEngine:
    """The GRPO rollout engine as ``replicas`` Ray actors; same ``generate`` / ``refit`` as the colocated ones.

    ``lm`` is the live policy LM (peft or plain) in this process: ``refit(None)`` merges it and broadcasts the
    result. ``engine`` names the engine each worker builds (``embedded`` or ``vllm``); ``model`` the model
    plugin registration the workers load the base from, and ``snapshot`` the local snapshot directory that
    replaced its source (the recipe's model.snapshot), whose ``base_fingerprint`` every worker must reproduce. Call :meth:`close` (or use it as a context
    manager) to stop the workers, leave the group and remove the placement group.
    """

    name = "ray"

    def __init__(self, lm: torch.nn.Module, *, engine: str, model: str, registry: Registry, pad_id: int,
                 eos_id: int | None,
                 suppress_ids: Sequence[int] = (), replicas: int = 1, gpus_per_replica: int = 1,
                 policy_gpus: int = 1, seed: int = 0, bucket_bytes: int = BUCKET_BYTES,
                 timeout_s: float = 600.0, ready_timeout_s: float = 120.0,
                 engine_options: Mapping[str, Any] | None = None, snapshot: Path | str | None = None,
                 base_fingerprint: str | None = None) -> None:
        try:
            import ray  # optional: ray ([ray] extra)
        except ImportError as exc:
            raise ImportError("stages.grpo.placement: ray needs Ray: pip install 'ray==2.60.0'") from exc
        if replicas < 1:
            raise ValueError(f"rollout_replicas={replicas}: expected at least 1")
        if gpus_per_replica != 1:
            raise ValueError(f"gpus.rollout={gpus_per_replica} per replica: a rollout replica spanning several GPUs "
                             f"(tensor-parallel engines) is not implemented; set parallel.gpus.rollout: 1 and "
                             f"raise parallel.rollout_replicas instead")
        self.source_lm = lm
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.dtype = dominant_dtype(lm)
        self.workers: list[Any] = []
        self.group: Any = None
        self.store: Any = None
        self.placement: Any = None
        self._started_ray = False
        try:
            if not ray.is_initialized():
                ray.init(include_dashboard=False)
                self._started_ray = True
            use_gpu = torch.cuda.is_available() and ray.cluster_resources().get("GPU", 0) > 0
            self.backend = "nccl" if use_gpu and next(lm.parameters()).is_cuda else "gloo"
            self.comm_device = next(lm.parameters()).device if self.backend == "nccl" else torch.device("cpu")
            self._place(ray, replicas, policy_gpus if use_gpu else 0, gpus_per_replica if use_gpu else 0,
                        ready_timeout_s)
            vocab = lm.get_output_embeddings().weight.shape[0]
            engine_config = None
            if engine == "vllm":
                with tempfile.TemporaryDirectory() as tmp:
                    engine_config = json.loads((write_engine_config(lm, Path(tmp)) / "config.json").read_text())
            env = {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_ENV)}
            from ray.util.scheduling_strategies import (
                PlacementGroupSchedulingStrategy,  # optional: ray ([ray] extra)
            )

            actor = ray.remote(RolloutWorker)
            specs = worker_specs(registry, engine, model)
            for i in range(replicas):
                strategy = PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=1 + i)
                self.workers.append(actor.options(
                    num_cpus=1, num_gpus=gpus_per_replica if use_gpu else 0, scheduling_strategy=strategy,
                ).remote(1 + i, engine=engine, model=model, specs=specs, dtype=str(self.dtype).removeprefix("torch."),
                         pad_id=pad_id, eos_id=eos_id, suppress_ids=list(suppress_ids), engine_config=engine_config,
                         vocab_size=vocab, env=env, seed=seed, engine_options=engine_options,
                         snapshot=None if snapshot is None else str(snapshot)))
            self.infos = ray.get([w.describe.remote() for w in self.workers])
            check_worker_bases(self.infos, model, snapshot, base_fingerprint)
            mine = _physical_gpu() if self.backend == "nccl" else None
            for info in self.infos:
                if mine is not None and mine in info["gpu_ids"]:
                    raise RuntimeError(f"rollout worker {info['rank']} was given GPU {mine}, which the policy uses; "
                                       f"Ray must not hand the policy's GPU to a rollout replica")
            merged = merged_state_dict(lm)
            reported = [info["expected"] for info in self.infos if info["expected"] is not None]
            if any(r != reported[0] for r in reported[1:]):
                raise RefitError("rollout workers loaded base models with different weight names or shapes")
            self.expected = reported[0] if reported else {n: tuple(t.shape) for n, t in merged.items()}
            self._open_group(ray)
            self.refit(merged)
        except BaseException:
            self.close()
            raise

    @classmethod
    def for_recipe(cls, recipe: Recipe, lm: torch.nn.Module, **kwargs: Any) -> RayRolloutEngine:
        """Replicas and GPUs per role from the recipe's ``parallel`` section (one replica when it has none)."""
        par = recipe.parallel
        if par is not None:
            kwargs.setdefault("replicas", par.rollout_replicas)
            kwargs.setdefault("gpus_per_replica", par.rollout_gpus)
            kwargs.setdefault("policy_gpus", par.policy_gpus)
        return cls(lm, **kwargs)

    def _place(self, ray: Any, replicas: int, policy_gpus: int, rollout_gpus: int, timeout_s: float) -> None:
        from ray.util.placement_group import placement_group  # optional: ray ([ray] extra)

        def bundle(gpus: int) -> dict[str, float]:
            return {"CPU": 1, **({"GPU": gpus} if gpus else {})}

        # bundle 0 is the policy's (this process): reserved so that no replica is placed on its GPU
        bundles = [bundle(policy_gpus)] + [bundle(rollout_gpus) for _ in range(replicas)]
        self.placement = placement_group(bundles, strategy="PACK")
        try:
            ray.get(self.placement.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            cpus = sum(b["CPU"] for b in bundles)
            gpus = sum(b.get("GPU", 0) for b in bundles)
            raise RuntimeError(
                f"the GRPO placement group was not ready after {timeout_s:.0f} s: it needs policy 1 CPU"
                f"{f' + {policy_gpus} GPU' if policy_gpus else ''} and {replicas} rollout replica(s) x (1 CPU"
                f"{f' + {rollout_gpus} GPU' if rollout_gpus else ''}) = {cpus} CPU" + (f", {gpus} GPU" if gpus else "")
                + f"; the cluster has {ray.cluster_resources()}") from None

    def _open_group(self, ray: Any) -> None:
        world = len(self.workers) + 1
        timeout = datetime.timedelta(seconds=self.timeout_s)
        host = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        joined = [w.join.remote(host, self.store.port, world, self.backend, self.timeout_s) for w in self.workers]
        self.group = new_group(self.store, 0, world, self.backend, timeout)
        ray.get(joined)

    # -- the engine interface ---------------------------------------------------------------------------

    def refit(self, weights: Mapping[str, torch.Tensor] | torch.nn.Module | None = None) -> None:
        """Broadcast new weights to every replica: a full merged state dict, a (peft) LM to merge, or ``None``
        for the live policy. The payload is validated whole before any worker is asked to receive."""
        import ray  # optional: ray ([ray] extra)

        if weights is None:
            weights = self.source_lm
        if isinstance(weights, torch.nn.Module):
            weights = merged_state_dict(weights)
        payload = validate_payload(self.expected, self.dtype, weights)
        manifest = manifest_of(payload)
        pending = [w.receive.remote(manifest, self.bucket_bytes) for w in self.workers]
        broadcast_state_dict(self.group, payload, manifest, self.comm_device, self.bucket_bytes)
        ray.get(pending)

    def generate(self, prompt_embeds: list[torch.Tensor], n: int, max_new_tokens: int, temperature: float = 1.0,
                 greedy: bool = False, seed: int | None = None) -> list[Completion]:
        """Completions for every prompt (``n`` each), in prompt order, with the engines' log-probs; ``seed``: the
        call's sampling seed (each replica samples from it and its rank, see :meth:`RolloutWorker.generate`)."""
        import ray  # optional: ray ([ray] extra)

        count, replicas = len(prompt_embeds), len(self.workers)
        pending, start = [], 0
        for r, worker in enumerate(self.workers):
            size = count // replicas + (1 if r < count % replicas else 0)
            if size:
                chunk = [e.detach().cpu() for e in prompt_embeds[start:start + size]]
                pending.append((start, worker.generate.remote(chunk, n, max_new_tokens, temperature, greedy, seed)))
            start += size
        results = ray.get([ref for _, ref in pending])
        return [Completion(c.prompt_index + offset, c.token_ids, c.logprobs)
                for (offset, _), chunk in zip(pending, results, strict=True) for c in chunk]

    def close(self) -> None:
        """Stop the workers, leave the refit group, remove the placement group (and Ray, if started here)."""
        import ray  # optional: ray ([ray] extra)

        workers, self.workers = self.workers, []
        if workers and ray.is_initialized():
            try:
                ray.get([w.close.remote() for w in workers], timeout=30)
            except Exception:  # noqa: BLE001 - a worker that died already has nothing to close
                pass
            for w in workers:
                ray.kill(w)
        group, self.group = self.group, None
        if group is not None:
            _close_group(group)
        self.store = None
        placement, self.placement = self.placement, None
        if placement is not None and ray.is_initialized():
            from ray.util.placement_group import remove_placement_group  # optional: ray ([ray] extra)

            remove_placement_group(placement)
        if self._started_ray:
            self._started_ray = False
            ray.shutdown()

    def __enter__(self) -> RayRolloutEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
