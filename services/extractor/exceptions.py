"""Why an extraction attempt failed, by what should happen next."""


class Transient(Exception):
    """The inference server or the disk is unavailable: wait and try again; the sample is not to blame."""


class SampleRejected(Exception):
    """This attempt produced nothing storable for this sample (bad dump, wrong token count, refused
    request): counted against the sample's attempts, then recorded as its failure."""
