"""The runtime's public surface: what a Python user needs to train a schedule or a plan.

    from pipeloom.runtime import TrainSpec, build_schedule, hf_workload, run_local, train_plan

A run is a `TrainSpec` (schedule, workload, parallel sizes, precision, optimizer, checkpoints);
`run_local` forks its ranks on this machine over gloo, `run_in_process` runs every device in this
process (messages in memory: for tests and quick checks), `train_rank` is one rank under
`torchrun`; `export_checkpoint` writes a checkpoint as a transformers directory; `reference_training` is the single-process run every schedule must reproduce. A
workload is the model, its data and its loss: the built-in decoder, any list of blocks, a Hugging
Face model or a torchvision ResNet; `build_schedule` is the planning core's, re-exported so
one import serves a training script. Importing this package imports torch.
"""

from pipeloom.models.hf import hf_workload
from pipeloom.models.vision import resnet_workload
from pipeloom.models.workload import Workload, blocks_workload, llama_workload
from pipeloom.runtime.export import export_checkpoint
from pipeloom.runtime.in_process import run_in_process
from pipeloom.runtime.local import run_local
from pipeloom.runtime.plan_run import spec_from_plan, train_plan
from pipeloom.runtime.spec import RankResult, TrainSpec
from pipeloom.runtime.training import reference_training, train_rank
from pipeloom.schedules import build_schedule

__all__ = [
    "RankResult",
    "TrainSpec",
    "Workload",
    "blocks_workload",
    "build_schedule",
    "export_checkpoint",
    "hf_workload",
    "llama_workload",
    "reference_training",
    "resnet_workload",
    "run_in_process",
    "run_local",
    "spec_from_plan",
    "train_plan",
    "train_rank",
]
