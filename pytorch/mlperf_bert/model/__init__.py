"""BERT for pretraining on flat (unpadded) tokens, and what shapes its arithmetic.

Owns: `bert.py` (the model; parameter names equal HuggingFace `BertForPreTraining`),
`attention.py` (the attention back-ends over flat tokens and `cu_seqlens`; `grouped_attention.py`
holds the grouped one, `varlen_flash.py` the varlen ones' kernels on PyTorch's flash attention and cuDNN's),
`init_checkpoint.py` (strict loading of the phase-1 checkpoint), `precision.py` (autocast),
`fp8.py` (the encoder's linear layers in FP8: torchao's recipes, or `fp8_delayed.py`'s delayed scaling),
`compiling.py` (regional torch.compile) and `flops.py` (the useful-FLOP formula).

May import: data/, config/, runtime/
"""
