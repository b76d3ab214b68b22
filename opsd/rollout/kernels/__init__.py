"""The rollout engine's Triton kernels, fenced off from the rest: the decode step's attention
(`attention`: split-KV flash decoding, with the new token's q/k/v work folded in), its q/k norms,
rotary embedding and cache writes (`qkv`, `qkv_triton`), the narrow products and the SiLU-gated
gate/up product (`matmul`), the top-k / top-p draw (`sampler`, `sampler_triton`), the merged
copy's LoRA refresh (`lora_merge`), and what they share (`triton_support`: when Triton is usable,
the one-warning fallback to torch). Each kernel has a module-level switch (`IMPLEMENTATION`; the attention's
`IMPLEMENTATIONS` names its choices): mostly "auto", the kernel on CUDA where it applies and torch
elsewhere (`lora_merge` defaults to torch: its kernel has not run on a GPU); Triton itself is
imported only when a kernel is built.
"""
