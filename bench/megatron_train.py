"""A small GPT trained the way ``megatron.training`` trains it, with each way of graphing its layers.

The model is Megatron-Core's ``GPTModel`` from its local (non-TransformerEngine) layer spec,
wrapped as ``megatron/training/training.py``'s ``get_model`` wraps it (``Float16Module`` for bf16,
Megatron's ``DistributedDataParallel`` built under its own stream, after making a side stream
current as ``initialize.py`` does for ``cuda_graph_impl="transformer_engine"``), and trained as its
``train`` loop does: ``create_cudagraphs()`` of ``TECudaGraphHelper`` at iteration
``cuda_graph_warmup_steps``, then per step ``zero_grad_buffer()``, the optimizer's
``zero_grad()``, Megatron's forward-backward schedule (``forward_backward_no_pipelining``, or the
interleaved pipeline schedule with ``--pp``/``--vpp``) and the optimizer step.

Arms (:data:`ARMS`): ``eager`` (``cuda_graph_impl="none"``); ``gograph``
(``"transformer_engine"`` with ``gograph.integrations.megatron.use_gograph()``); ``te`` (the same
path with TransformerEngine's ``make_graphed_callables``, where TransformerEngine is installed);
``local`` (``"local"``: Megatron's own ``CudaGraphManager``, CUDA only).

On the CPU (``--device cpu``) Megatron's CUDA hard-codings are redirected (megatron_cpu.py),
gograph runs its eager engine, and the optimizer is :class:`HostMixedPrecisionSGD` (Megatron's
checks ``torch.cuda`` tensor types); on CUDA it is Megatron's (``get_megatron_optimizer``, Adam).
Without TransformerEngine, megatron_te_surface.py provides the names its graph path imports.

Run as a script it trains the arms one after another in this process (the same seeds and data)
and saves one :class:`Trace` per arm (``--out``), which tests and bench/megatron.py compare:

  python bench/megatron_train.py --device cpu --arms eager,gograph --out /tmp/traces.pt
  torchrun --nproc-per-node 2 bench/megatron_train.py --device cpu --pp 2 --vpp 2 --layers 4 --arms eager,gograph \
      --out /tmp/traces.pt                                   # rank r saves /tmp/traces.pt.rank<r>
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

# Megatron-Core's ``megatron`` is a namespace package, which any ``megatron.py`` on sys.path
# shadows -- bench/megatron.py included: import it with bench/ off the path, then add bench/.
_BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _BENCH]
sys.path.insert(0, os.path.join(os.path.dirname(_BENCH), "python"))
try:
    import megatron.core  # noqa: F401
except ImportError as e:
    raise SystemExit(
        f"{os.path.basename(__file__)} needs Megatron-Core (pip install megatron-core==0.19.2): {e}"
    ) from e
sys.path.append(_BENCH)

ARMS = ("eager", "gograph", "te", "local")
_IMPL = {"eager": "none", "gograph": "transformer_engine", "te": "transformer_engine", "local": "local"}


@dataclass(frozen=True)
class RunConfig:
    """Sizes and schedule of a run; one per process (Megatron's parallel state is global)."""

    device: str = "cpu"
    layers: int = 2
    hidden: int = 32
    heads: int = 4
    vocab: int = 64
    seq: int = 16
    micro_batch: int = 2
    microbatches: int = 2  # per step (data parallel size 1)
    steps: int = 4
    warmup_steps: int = 1  # cuda_graph_warmup_steps: graphs made before step `warmup_steps`
    pp: int = 1
    vpp: int | None = None
    lr: float = 1e-2
    seed: int = 1234

    @property
    def chunks(self) -> int:
        return self.vpp or 1


@dataclass
class Trace:
    """What one arm's training produced (on the CPU), and what it graphed."""

    arm: str
    losses: list[list[torch.Tensor]] = field(default_factory=list)  # per step, per microbatch
    main_grads: list[dict[str, torch.Tensor]] = field(default_factory=list)  # per step, after the schedule
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # after the last step
    graphs: dict[str, Any] = field(default_factory=dict)  # what the layers got (graphed arms)
    step_seconds: list[float] = field(default_factory=list)
    peak_reserved: int | None = None  # bytes over the model's footprint (CUDA)


# ---------------------------------------------------------------------------------------------
# process setup
# ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    """A TCP port nothing listens on now (a port derived from the pid collided with another
    process's store on a busy machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def setup(cfg: RunConfig, graphed: bool) -> None:
    """torch.distributed (gloo on the CPU, NCCL on CUDA), Megatron's parallel state, microbatch
    calculator and RNG tracker; for graphed runs on CUDA a side stream made current, as
    ``megatron/training/initialize.py`` does before anything is built."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if graphed:
            torch.cuda.set_stream(torch.cuda.Stream())
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        backend = "nccl" if cfg.device == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, rank=rank, world_size=world)
    if world != cfg.pp:
        raise SystemExit(
            f"megatron_train: --pp {cfg.pp} needs {cfg.pp} ranks (tensor and data parallel 1), got {world}"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=cfg.pp,
        virtual_pipeline_model_parallel_size=cfg.vpp,
    )
    init_num_microbatches_calculator(rank, None, cfg.micro_batch * cfg.microbatches, cfg.micro_batch, 1)


def seed(cfg: RunConfig) -> None:
    """The same initial state for every arm (CPU initialization, then the RNG tracker)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(cfg.seed)
    model_parallel_cuda_manual_seed(cfg.seed, use_cudagraphable_rng=cfg.device == "cuda")


@contextlib.contextmanager
def on_device(cfg: RunConfig) -> Iterator[None]:
    """Megatron's CUDA hard-codings redirected to the host for CPU runs."""
    if cfg.device != "cpu":
        yield
        return
    from megatron_cpu import redirected

    with redirected():
        yield


# ---------------------------------------------------------------------------------------------
# model and optimizer, as megatron.training builds them
# ---------------------------------------------------------------------------------------------
def transformer_config(cfg: RunConfig, arm: str) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=cfg.layers,
        hidden_size=cfg.hidden,
        num_attention_heads=cfg.heads,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        pipeline_dtype=torch.bfloat16,
        pipeline_model_parallel_size=cfg.pp,
        virtual_pipeline_model_parallel_size=cfg.vpp,
        cuda_graph_impl=_IMPL[arm],
        cuda_graph_warmup_steps=cfg.warmup_steps,
    )


def build_model(cfg: RunConfig, arm: str) -> list[Any]:
    """Model chunks (one per virtual stage) in Float16Module and Megatron's DDP."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel.utils import (
        is_pp_first_stage,
        is_pp_last_stage,
        is_vp_first_stage,
        is_vp_last_stage,
    )
    from megatron.core.transformer.module import Float16Module

    config = transformer_config(cfg, arm)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    seed(cfg)
    chunks = []
    for vp in range(cfg.chunks):
        vp_stage = vp if cfg.vpp else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=cfg.vocab,
            max_sequence_length=cfg.seq,
            pre_process=is_pp_first_stage(pp_group) and is_vp_first_stage(vp, cfg.vpp),
            post_process=is_pp_last_stage(pp_group) and is_vp_last_stage(vp, cfg.vpp),
            vp_stage=vp_stage,
        )
        if cfg.device == "cuda":
            model.cuda(torch.cuda.current_device())
        chunks.append(Float16Module(config, model))
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    ddp_stream = torch.cuda.Stream()  # get_model: DDP under a stream of its own
    ddp_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(ddp_stream):
        chunks = [
            DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
            for i, chunk in enumerate(chunks)
        ]
    torch.cuda.current_stream().wait_stream(ddp_stream)
    return chunks


class HostMixedPrecisionSGD:
    """The data flow of Megatron's ``Float16OptimizerWithFloat16Params`` on the CPU (which that
    class refuses: it checks ``torch.cuda`` tensor types): fp32 main copies of the bf16 params
    take the fp32 ``main_grad`` of DDP's buffer, step with SGD, and are copied back."""

    def __init__(self, model: list[Any], lr: float) -> None:
        self.params = [p for chunk in model for p in chunk.parameters() if p.requires_grad]
        self.main = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.inner = torch.optim.SGD(self.main, lr=lr)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for p, m in zip(self.params, self.main):
            m.grad = p.main_grad.float()
        self.inner.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.main):
                p.copy_(m)


def build_optimizer(cfg: RunConfig, model: list[Any]) -> Any:
    if cfg.device == "cpu":
        return HostMixedPrecisionSGD(model, cfg.lr)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    return get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=cfg.lr, bf16=True, params_dtype=torch.float32, clip_grad=1.0), model
    )


# ---------------------------------------------------------------------------------------------
# data and the forward step (pretrain_gpt.py's shape of it)
# ---------------------------------------------------------------------------------------------
def batches(cfg: RunConfig) -> list[list[dict[str, torch.Tensor]]]:
    """Per step, per microbatch: tokens, labels, loss mask, position ids and the causal
    attention mask ``[b, 1, s, s]`` (True: masked), as Megatron's GPT dataset makes them."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    dev = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    s, b = cfg.seq, cfg.micro_batch
    mask = (torch.tril(torch.ones(s, s)) < 0.5).view(1, 1, s, s).expand(b, 1, s, s).contiguous()
    out = []
    for _ in range(cfg.steps):
        step = []
        for _ in range(cfg.microbatches):
            tokens = torch.randint(0, cfg.vocab, (b, s + 1), generator=gen)
            step.append(
                {
                    "tokens": tokens[:, :-1].contiguous().to(dev),
                    "labels": tokens[:, 1:].contiguous().to(dev),
                    "loss_mask": torch.ones(b, s).to(dev),
                    "position_ids": torch.arange(s).unsqueeze(0).expand(b, s).contiguous().to(dev),
                    "attention_mask": mask.to(dev),
                }
            )
        out.append(step)
    return out


def _loss_func(loss_mask: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    losses = output.float()
    loss = torch.sum(losses.view(-1) * loss_mask.view(-1)) / loss_mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(
    data_iterator: Iterator[dict[str, torch.Tensor]], model: Any
) -> tuple[torch.Tensor, Callable[..., Any]]:
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


# ---------------------------------------------------------------------------------------------
# the training loop
# ---------------------------------------------------------------------------------------------
class Run:
    """One arm: its model, optimizer and graph helper; :meth:`step` is one ``train_step``."""

    def __init__(self, cfg: RunConfig, arm: str) -> None:
        if arm not in ARMS:
            raise SystemExit(f"megatron_train: unknown arm {arm!r} (one of {', '.join(ARMS)})")
        self.cfg, self.arm = cfg, arm
        self.model = build_model(cfg, arm)
        self.config = self.model[0].config
        self.optimizer = build_optimizer(cfg, self.model)
        self.config.grad_scale_func = self.optimizer.scale_loss
        if self.config.finalize_model_grads_func is None:
            from megatron.core.distributed import finalize_model_grads

            self.config.finalize_model_grads_func = finalize_model_grads
        self.helper = self._helper() if _IMPL[arm] == "transformer_engine" else None
        self.iteration = 0

    def _helper(self) -> Any:
        from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

        return TECudaGraphHelper(
            model=self.model,
            config=self.config,
            seq_length=self.cfg.seq,
            micro_batch_size=self.cfg.micro_batch,
            optimizers=[self.optimizer],
        )

    def step(self, data: list[dict[str, torch.Tensor]]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        """training.py: graphs at iteration cuda_graph_warmup_steps, then one train_step. Returns
        the microbatch losses and the main grads the schedule left (before the optimizer)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if self.helper is not None and not self.helper.capture_finished() and self.iteration == self.cfg.warmup_steps:
            _bind(self.arm)
            self.helper.create_cudagraphs()
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        iterators = [iter(data) for _ in self.model]
        losses = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=self.model,
            num_microbatches=self.cfg.microbatches,
            seq_length=self.cfg.seq,
            micro_batch_size=self.cfg.micro_batch,
            decoder_seq_length=self.cfg.seq,
            forward_only=False,
        )
        grads = {name: p.main_grad.detach().float().cpu().clone() for name, p in self.named_parameters()}
        self.optimizer.step()
        self.iteration += 1
        return [d["lm loss"].cpu() for d in losses], grads

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        for i, chunk in enumerate(self.model):
            for name, p in chunk.named_parameters():
                yield f"chunk{i}.{name}", p

    def graphs(self) -> dict[str, Any]:
        """What Megatron's layers hold: the graphed callables' types and engines, live graphs."""
        import gograph

        held = [g for chunk in self.model for layer in _layers(chunk) for g in getattr(layer, "cuda_graphs", [])]
        return {
            "count": len(held),
            "labels": [str(getattr(g, "label", "")) for g in held],
            "types": sorted({type(g).__name__ for g in held}),
            "engines": sorted({g.engine.name for g in held if isinstance(g, gograph.GraphedCallable)}),
            "chained": sum(1 for g in held if isinstance(g, gograph.GraphedCallable) and g.chained_inputs),
            "live_graphs": gograph.live_graphs(),
        }


def differences(ref: dict[str, Any], other: dict[str, Any]) -> list[str]:
    """Where two saved traces (``dataclasses.asdict(Trace)``) differ, bit for bit: every
    microbatch loss, every step's main grads, the final parameters. Empty: bitwise equal."""
    out = []
    if len(ref["losses"]) != len(other["losses"]):
        return [f"{len(ref['losses'])} steps against {len(other['losses'])}"]
    for step, (a, b) in enumerate(zip(ref["losses"], other["losses"])):
        if len(a) != len(b) or not all(torch.equal(x, y) for x, y in zip(a, b)):
            out.append(f"step {step} losses {[x.item() for x in a]} vs {[y.item() for y in b]}")
    for step, (a, b) in enumerate(zip(ref["main_grads"], other["main_grads"])):
        bad = sorted(k for k in a if k not in b or not torch.equal(a[k], b[k]))
        if bad or a.keys() != b.keys():
            out.append(f"step {step} main_grad of {bad[:4]}{' ...' if len(bad) > 4 else ''}")
    bad = sorted(k for k in ref["params"] if not torch.equal(ref["params"][k], other["params"].get(k, torch.empty(0))))
    if bad:
        out.append(f"final params {bad[:4]}{' ...' if len(bad) > 4 else ''}")
    return out


def _layers(chunk: Any) -> list[Any]:
    module = chunk
    while hasattr(module, "module"):
        module = module.module
    decoder = getattr(module, "decoder", None)
    return list(decoder.layers) if decoder is not None else []


def _bind(arm: str) -> None:
    """The make_graphed_callables Megatron's helper calls: gograph's for the gograph arm,
    TransformerEngine's (Megatron's own binding) for the te arm."""
    import gograph.integrations.megatron as gm

    if arm == "gograph":
        gm.use_gograph()
    else:
        gm.use_transformer_engine()


def train(cfg: RunConfig, arm: str, data: list[list[dict[str, torch.Tensor]]]) -> Trace:
    """One arm from a fresh model, every step recorded."""
    trace = Trace(arm)
    run = Run(cfg, arm)
    base = 0
    if cfg.device == "cuda":  # relative to the model and optimizer as built
        torch.cuda.synchronize()
        base = torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
    for step in data:
        t0 = time.perf_counter()
        losses, grads = run.step(step)
        if cfg.device == "cuda":
            torch.cuda.synchronize()
        trace.step_seconds.append(time.perf_counter() - t0)
        trace.losses.append(losses)
        trace.main_grads.append(grads)
    trace.params = {name: p.detach().float().cpu().clone() for name, p in run.named_parameters()}
    if cfg.device == "cuda":
        trace.peak_reserved = torch.cuda.max_memory_reserved() - base
    if run.helper is not None:
        trace.graphs = run.graphs()
        if run.helper.graphs_created():
            run.helper.delete_cuda_graphs()
    return trace


def prepare(cfg: RunConfig, arms: list[str]) -> None:
    """Process setup for ``arms``: parallel state, and for the TransformerEngine path the names
    it imports where TransformerEngine is absent (which a ``te`` arm cannot do without)."""
    import megatron.core.transformer.cuda_graphs  # noqa: F401 (Megatron first, then the surface)

    from megatron_te_surface import provide, real_transformer_engine

    if "te" in arms and not real_transformer_engine():
        raise SystemExit("megatron_train: the te arm needs TransformerEngine (pip install transformer-engine[pytorch])")
    if "local" in arms and cfg.device != "cuda":
        raise SystemExit("megatron_train: the local arm (Megatron's CudaGraphManager) needs CUDA")
    provide()
    setup(cfg, graphed=any(_IMPL[a] != "none" for a in arms))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--arms", default="eager,gograph")
    ap.add_argument("--out", required=True, help="where to torch.save the traces (rank r of a pipeline: OUT.rank<r>)")
    for f in dataclasses.fields(RunConfig):
        if f.name != "device":
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=float if f.name == "lr" else int, default=None)
    args = ap.parse_args(argv)
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(RunConfig) if f.name != "device"}
    cfg = RunConfig(device=args.device, **{k: v for k, v in given.items() if v is not None})
    arms = args.arms.split(",")
    with on_device(cfg):
        prepare(cfg, arms)
        data = batches(cfg)
        traces = [train(cfg, arm, data) for arm in arms]
    rank = torch.distributed.get_rank()
    torch.save([dataclasses.asdict(t) for t in traces], args.out if cfg.pp == 1 else f"{args.out}.rank{rank}")
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
