"""``towers bench --predict``: step time on GPU topologies from a cost model.

For a model whose gradients are S bytes, a compute time c per step (forward +
backward of one tower's batch) and n towers:

- **parameter device** (variables on the CPU): every tower sends its S bytes of
  gradient and receives S bytes of variables over its own link; the host side
  carries all of it: ``sync = max(2S / link, 2nS / host)``.
- **ring all-reduce**: each member sends and receives ``2S(n-1)/n`` over its
  link: ``sync = 2S(n-1)/n / link`` (and nothing for n = 1).

Two bounds: no overlap, ``step = c + sync`` (every byte waits for the backward
pass to end), and full overlap, ``step = max(c, sync)`` (transfers hide behind
the backward pass, as TensorFlow's and Horovod's do in part). Throughput is
``n * batch / step``. docs/sync-cost.md checks it against published numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str
    kind: str  # "parameter" or "ring"
    link_gbps: float  # GB/s each way on one member's link
    host_gbps: float  # GB/s the parameter device can carry in total
    about: str


TOPOLOGIES = {
    "pcie-cpu": Topology(
        "pcie-cpu",
        "parameter",
        12.0,
        48.0,
        "variables on the CPU; each GPU on a PCIe 3.0 x16 link (~12 GB/s each "
        "way); the host carries 4 such links at once (a DGX-1's 4 PCIe switches)",
    ),
    "nvlink-ring": Topology(
        "nvlink-ring",
        "ring",
        18.0,
        0.0,
        "ring all-reduce over NVLink 1.0 (20 GB/s per link each way, ~18 usable)",
    ),
    "ethernet-ring": Topology(
        "ethernet-ring",
        "ring",
        25 / 8,
        0.0,
        "ring all-reduce between machines over 25 Gbit/s Ethernet (3.1 GB/s)",
    ),
}


def sync_ms(model_bytes: float, towers: int, topology: Topology) -> float:
    """Milliseconds of gradient traffic per step.

    Example:
      >>> round(sync_ms(1.2e9, 4, TOPOLOGIES["pcie-cpu"]), 1)  # 2.4 GB at 12 GB/s
      200.0
    """
    if topology.kind == "parameter":
        per_link = 2 * model_bytes / (topology.link_gbps * GB)
        host = 2 * towers * model_bytes / (topology.host_gbps * GB)
        return 1e3 * max(per_link, host)
    return 1e3 * 2 * model_bytes * (towers - 1) / towers / (topology.link_gbps * GB)


def predict(
    model_bytes: float,
    compute_ms: float,
    batch: int,
    towers: Sequence[int],
    topology: Topology,
) -> list[dict[str, float]]:
    """Per tower count: sync time, both step-time bounds and their throughputs.

    Efficiency is against one tower on the same topology, without overlap.
    """
    one_tower = compute_ms + sync_ms(model_bytes, 1, topology)
    rows = []
    for num in towers:
        sync = sync_ms(model_bytes, num, topology)
        no_overlap, overlap = compute_ms + sync, max(compute_ms, sync)
        rows.append(
            {
                "towers": num,
                "sync_ms": sync,
                "step_ms_no_overlap": no_overlap,
                "step_ms_full_overlap": overlap,
                "examples_per_second_no_overlap": 1e3 * num * batch / no_overlap,
                "examples_per_second_full_overlap": 1e3 * num * batch / overlap,
                "efficiency_no_overlap": one_tower / no_overlap,
            }
        )
    return rows


# Published: ResNet-50, batch 64 per GPU, variables on the CPU, 1/2/4/8 P100
# (TensorFlow performance guide, 2017), images/s.
RESNET50_P100 = {1: 219, 2: 422, 4: 852, 8: 1734}
RESNET50_BYTES = 25.6e6 * 4
# Forward + backward FLOPs relative to ResNet-50 (4.1 GFLOPs): how the compute
# time measured for ResNet-50 is carried to the models Horovod reported on.
HOROVOD_MODELS = {
    "ResNet-101": (44.5e6 * 4, 7.8 / 4.1),
    "Inception V3": (23.8e6 * 4, 5.7 / 4.1),
}
HOROVOD_MACHINES, HOROVOD_GPUS_PER_MACHINE = 32, 4  # 128 Pascal GPUs


def resnet50_compute_ms() -> float:
    """One P100's ResNet-50 compute time, from its published 1-GPU throughput
    minus the 1-GPU traffic to the CPU."""
    step = 1e3 * 64 / RESNET50_P100[1]
    return step - sync_ms(RESNET50_BYTES, 1, TOPOLOGIES["pcie-cpu"])


def published_checks() -> dict[str, list[dict[str, float]]]:
    """The model against the published numbers: ResNet-50 on 1-8 P100s with
    variables on the CPU, and Horovod's 128-GPU scaling efficiency."""
    compute = resnet50_compute_ms()
    rows = predict(
        RESNET50_BYTES, compute, 64, sorted(RESNET50_P100), TOPOLOGIES["pcie-cpu"]
    )
    for row in rows:
        row["published"] = RESNET50_P100[row["towers"]]
        row["error_no_overlap"] = (
            row["examples_per_second_no_overlap"] / row["published"] - 1
        )
    horovod = []
    for name, (nbytes, flops) in HOROVOD_MODELS.items():
        # Within a machine NCCL is fast; the ring between machines is the limit.
        (row,) = predict(
            nbytes, compute * flops, 64, [HOROVOD_MACHINES], TOPOLOGIES["ethernet-ring"]
        )
        horovod.append(
            {"model": name, "efficiency_no_overlap": row["efficiency_no_overlap"]}
        )
    return {"resnet50_p100": rows, "horovod_128": horovod}


def print_prediction(
    model_bytes: float | None,
    compute_ms: float | None,
    batch: int,
    towers: Sequence[int],
) -> None:
    """Prints the published checks, then (given a compute time) the projection."""
    checks = published_checks()
    print(
        "Check 1: ResNet-50, batch 64 per GPU, variables on the CPU, P100s "
        f"(pcie-cpu; compute {resnet50_compute_ms():.0f} ms from the 1-GPU number)"
    )
    print(
        f"{'GPUs':>4} {'published':>10} {'no overlap':>11} {'error':>7} {'overlap':>8}"
    )
    for row in checks["resnet50_p100"]:
        print(
            f"{row['towers']:>4} {row['published']:>10.0f} "
            f"{row['examples_per_second_no_overlap']:>11.0f} "
            f"{row['error_no_overlap']:>+7.1%} "
            f"{row['examples_per_second_full_overlap']:>8.0f}"
        )
    print("Check 2: Horovod, 128 GPUs (32 machines x 4), 25 Gbit/s Ethernet ring")
    for row in checks["horovod_128"]:
        print(
            f"  {row['model']:<13} efficiency {row['efficiency_no_overlap']:.0%} "
            "without overlap, 100% with full overlap; published 88-90%"
        )
    if compute_ms is None or model_bytes is None:
        print(
            "Pass --compute-ms (one tower's forward + backward on the target GPU) "
            "to project the preset."
        )
        return
    for topology in TOPOLOGIES.values():
        print(f"\n{topology.name}: {topology.about}")
        header = ["towers", "sync ms", "step ms", "examples/s", "eff"]
        print("{:>6} {:>8} {:>16} {:>18} {:>5}".format(*header))
        for row in predict(model_bytes, compute_ms, batch, towers, topology):
            steps = f"{row['step_ms_full_overlap']:.2f}-{row['step_ms_no_overlap']:.2f}"
            rates = (
                f"{row['examples_per_second_no_overlap']:.0f}-"
                f"{row['examples_per_second_full_overlap']:.0f}"
            )
            print(
                f"{row['towers']:>6} {row['sync_ms']:>8.2f} {steps:>16} {rates:>18} "
                f"{row['efficiency_no_overlap']:>5.0%}"
            )
