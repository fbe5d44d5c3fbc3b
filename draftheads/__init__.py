"""draftheads: train, export and decode with speculative-decoding draft heads.

Subpackages: ``heads`` (Medusa, EAGLE, EAGLE-3, MTP), ``data`` (conversations -> examples),
``train`` (the DeepSpeed loop), ``infer`` (tree-based lossless speculative decoding).
Nothing heavy is imported here.
"""

__version__ = "0.1.0"
