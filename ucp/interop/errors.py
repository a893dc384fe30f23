"""Errors for foreign checkpoints: each message names the file, tensor or rank at fault."""

from __future__ import annotations

from ..errors import UcpError


class InteropError(UcpError):
    """A foreign checkpoint (Megatron, Hugging Face, DCP) is incomplete, inconsistent or cannot be mapped."""


class SourceMismatchError(InteropError):
    """The source is not what the command was told it is (another architecture, layout or format)."""


class DestinationExistsError(InteropError):
    """The destination already holds something; interop commands never write over existing output."""


class ModelMismatchError(SourceMismatchError):
    """A step holds another model than the one an inference engine serves (another family, shape or set of
    weights): a refresh from it is refused before any weight changes, and the engine keeps serving what it served."""
