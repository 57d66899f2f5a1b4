"""The model: GPT-2 on one device, knowing nothing of Ray or torch.distributed.

    gpt.py          GPT-2 with GPT-2's names; its parameters in llm.c's tensor order
    shapes.py       GPT-2's shapes by depth (-e dN), for the model and the config (no torch)
    memory.py       one worker's peak memory estimated from the shape (preflight, OOM lines)
    torch_compat.py the private torch API raygpt relies on, in one place

Its kernels (Triton, each with a PyTorch reference) are raygpt.ops.
"""
