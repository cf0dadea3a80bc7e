"""``zero1_mpi.layout``, kept for user code: the flat layout lives in ``zero1_mpi.flat.layout``."""

from .flat.layout import (
    DEFAULT_ALIGN,
    DEFAULT_BUCKET_ELEMENTS,
    Bucket,
    Layout,
    TensorSlot,
    build_layout,
    check_bucket_elements,
)

__all__ = [
    "Layout",
    "Bucket",
    "TensorSlot",
    "build_layout",
    "check_bucket_elements",
    "DEFAULT_ALIGN",
    "DEFAULT_BUCKET_ELEMENTS",
]
