"""The TPU and GPU compilers without the chips: StableHLO modules compiled by libtpu for named TPUs and by XLA's GPU
compiler for named NVIDIA GPUs (deviceless, cubins from ptxas), their figures as JSON.

Run by the compile-only venv's python (``scripts/setup_compile_env.sh``), never imported by the package: it imports
JAX alone (no torch, no deepspeed_xla), since libtpu and torch_xla's TPU build cannot share a process.
``bench/tpu_compile.py`` writes the job and reads the result:

    python tpu_compiler.py JOB.json OUT.json

JOB: ``{"chips": ["v5e", "h100", ...], "gpu_targets": {"h100": "h100_sxm.txtpb", ...}, "graphs": [{"name": ...,
"path": "step.mlir", "replicas": 1}, ...]}``; a chip in ``gpu_targets`` is a GPU described by that
GpuTargetConfigProto file. OUT: one entry per graph and chip, its compile seconds, ``get_compiled_memory_stats()`` per
chip and XLA's cost analysis, or the compiler's refusal (``error``). JAX's compile-only client compiles for a
topology's devices; a 1-chip topology is refused by libtpu, so a graph of one replica is compiled for the first device
of the smallest slice (docs/performance.md, 'What the TPU compiler says'). A GPU executable has no cost analysis
without a device, so XLA's generic one is run over its optimised (fused) HLO: FLOPs and bytes, no time estimate.
"""
import json
import os
import sys
import time

#: slices to compile on, smallest first; a graph of n replicas takes the first with at least n chips
TOPOLOGIES = {"v5e": ("v5e:2x2", "v5e:2x4"), "v5p": ("v5p:2x2x1", "v5p:2x2x2"), "v6e": ("v6e:2x2", "v6e:2x4")}
#: quiets libtpu's probe of a TPU VM's metadata server, which this machine is not; and lets two compiling processes
#: load libtpu at once (else the second is refused: "Internal error when accessing libtpu multi-process lockfile"),
#: which holds no chip here
ENVIRONMENT = {"JAX_PLATFORMS": "cpu", "TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v5litepod-4",
               "TPU_WORKER_HOSTNAMES": "localhost", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
MEMORY = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
          "generated_code_size_in_bytes")
COST = ("flops", "bytes accessed", "transcendentals", "optimal_seconds", "utilization")


def _devices(chip: str, replicas: int, topologies: dict, gpu_targets: dict) -> list:
    from jax.experimental import topologies as jax_topologies
    if chip in gpu_targets:  # partitions x hosts x GPUs per host
        name = f"{chip}:1x1x{replicas}"
        if name not in topologies:
            with open(gpu_targets[chip]) as handle:
                topologies[name] = jax_topologies.get_topology_desc(platform="cuda", topology_name="",
                                                                    topology=f"1x1x{replicas}",
                                                                    target_config=handle.read())
        return list(topologies[name].devices)
    for name in TOPOLOGIES[chip]:
        if name not in topologies:
            topologies[name] = jax_topologies.get_topology_desc(platform="tpu", topology_name=name)
        if len(topologies[name].devices) >= replicas:
            return list(topologies[name].devices[:replicas])
    raise ValueError(f"no {chip} slice of {replicas} chips here: the largest is {TOPOLOGIES[chip][-1]}")


def _gpu_cost(executable) -> dict:
    import jax
    from jax._src.lib import _jax
    return _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, executable.hlo_modules()[0])


def compile_one(text: str, chip: str, replicas: int, topologies: dict, gpu_targets: dict) -> dict:
    """One module compiled for ``replicas`` chips of ``chip``: its figures, or the compiler's refusal."""
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client
    from jax._src.lib.mlir import ir
    began = time.monotonic()
    try:
        devices = _devices(chip, replicas, topologies, gpu_targets)
        with mlir.make_ir_context():
            module = ir.Module.parse(text)
            options = compiler.get_compile_options(num_replicas=replicas, num_partitions=1)
            executable = devices[0].client.compile(module, executable_devices=xla_client.DeviceList(tuple(devices)),
                                                   compile_options=options)
    except Exception as error:  # the compiler's refusal, reported per graph and chip
        return {"error": f"{type(error).__name__}: {error}"}
    seconds = time.monotonic() - began
    stats = executable.get_compiled_memory_stats()
    analysis = _gpu_cost(executable) if chip in gpu_targets else executable.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    return {"compile_s": seconds, "memory": {key: int(getattr(stats, key)) for key in MEMORY},
            "cost": {key: float(analysis[key]) for key in COST if key in analysis}}


def main(job_path: str, out_path: str) -> int:
    with open(job_path) as handle:
        job = json.load(handle)
    topologies: dict = {}
    results = []
    for graph in job["graphs"]:
        with open(graph["path"]) as handle:
            text = handle.read()
        for chip in job["chips"]:
            result = compile_one(text, chip, graph.get("replicas", 1), topologies, job.get("gpu_targets", {}))
            results.append(dict(result, graph=graph["name"], chip=chip))
            print(f"{graph['name']} {chip}: {results[-1].get('error') or 'compiled'}", file=sys.stderr, flush=True)
            with open(out_path, "w") as handle:  # after each: a long job stopped keeps what it compiled
                json.dump(results, handle)
    return 0


if __name__ == "__main__":
    for key, value in ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    sys.exit(main(*sys.argv[1:]))
