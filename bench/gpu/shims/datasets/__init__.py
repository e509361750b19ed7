"""Stand-in for Hugging Face `datasets`, which SpecForge's data modules import at import time: its offline
training (features prepared ahead) never builds a dataset, and the real package (pyarrow, pandas) does not fit
the transfer. Any use fails loudly."""


class Dataset:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("datasets is not installed here: only SpecForge's offline training is supported")


def load_dataset(*args, **kwargs):
    raise RuntimeError("datasets is not installed here: only SpecForge's offline training is supported")
