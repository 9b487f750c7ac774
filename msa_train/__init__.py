"""msa-train: long-context training with Native Sparse Attention."""


def patch_model(model, attention_cfg=None, **kwargs):
    """See :func:`msa_train.models.patch_model` (imported lazily to keep the CLI fast)."""
    from msa_train.models import patch_model as _patch

    return _patch(model, attention_cfg, **kwargs)


__all__ = ["patch_model"]
