"""The ingested samples' files, read while (or after) they are written."""

import os

from eaglet.shared.samples import SampleSet, SampleWriter


def test_an_index_row_whose_tokens_are_not_on_disk_yet_is_not_read(tmp_path):
    """The writer's three files reach the disk one by one; a reader (a worker, or an ingest taken up after its
    worker was killed) that finds an index row ahead of its tokens sees the samples before it, and no error."""
    writer = SampleWriter(tmp_path)
    writer.append("a", [1, 2, 3], [0, 1, 1])
    writer.append("b", [4, 5], [1, 1])
    writer.close({})
    with open(tmp_path / "loss_mask.bin", "r+b") as f:  # as after a kill: b's mask never reached the disk
        f.truncate(os.path.getsize(tmp_path / "loss_mask.bin") - 1)
    samples = SampleSet(tmp_path)
    assert len(samples) == 1 and samples[0].sample_id == "a" and samples[0].input_ids.tolist() == [1, 2, 3]
