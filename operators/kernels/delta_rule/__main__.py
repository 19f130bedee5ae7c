"""On a GPU machine with fla installed: fla's kernels against ours (`check.compare_with_torch`)."""
import torch

from vlbatch.operators.kernels.delta_rule import select_delta_rule
from vlbatch.operators.kernels.delta_rule.check import compare_with_torch

for dt in (torch.float32, torch.bfloat16):
    print(f"fla vs torch kernels, {dt}: {compare_with_torch(select_delta_rule('cuda', 'fla'), 'cuda', dt)}")
