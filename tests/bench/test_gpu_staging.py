"""The GPU machine is given every third-party module eaglet's GPU runs import: staged by bench/gpu/stage.sh or in
the image (its package lists in results/). A module neither provides stops a GPU run at import."""

import textwrap

from bench.gpu import staging


def test_every_module_the_gpu_runs_import_is_staged_or_in_the_image():
    entries, tree = staging.gpu_entries()
    sites = staging.third_party_imports(entries, tree)
    modules = {s.module for s in sites}
    # the walk reaches the trainer (through its main), the plugin and the workers' lazy imports
    assert {"torch", "tensorboardX", "sglang", "redis", "rq"} <= modules
    missing = staging.find_missing(sites, staging.provided_distributions())
    assert not missing, "not staged by bench/gpu/stage.sh and not in the image:\n" + staging.report(missing)


def test_a_module_nothing_provides_is_reported_with_its_file_and_line(tmp_path):
    def write(rel, text):
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
        return path

    write("app/__init__.py", "")
    write("app/entry.py", "import json\nfrom app import helpers\nfrom .jobs import run\n")
    helper = write("app/helpers.py", "import staged_one\n\n\ndef later():\n    import zz_made_up_dist.sub\n")
    write("app/jobs.py", 'JOB = "app.queued.work"\n\n\ndef run():\n    pass\n')
    queued = write("app/queued.py", "def work():\n    from imaged_one import x\n    import zz_made_up_dist\n")
    write("app/unreached.py", "import never_imported\n")
    stage = write(
        "stage.sh",
        """\
        DEPS="staged-one==1.0
          other==2.0"
        dl "$WORK/dl" $DEPS
        dl "$STAGE/p1/eaglet" fake-extra==0.1
        """,
    )
    listing = write("machine.txt", "Mon Nov 30 05:11:05 AM UTC 2026\n16\nimaged_one              3.1\n")

    sites = staging.third_party_imports(["app.entry"], staging.Tree({"app": tmp_path / "app"}))
    assert {s.module for s in sites} == {"staged_one", "zz_made_up_dist", "imaged_one"}
    provided = staging.stage_distributions(stage) | staging.listed_distributions([listing])
    assert provided == {"staged-one", "other", "fake-extra", "imaged-one"}

    missing = staging.find_missing(sites, provided, installed={"staged_one": ["Staged_One"]})
    assert [(m.module, m.distribution) for m in missing] == [("zz_made_up_dist", "zz-made-up-dist")]
    assert [(s.path, s.line) for s in missing[0].sites] == [(helper, 5), (queued, 3)]
    assert [s.where(tmp_path) for s in missing[0].sites] == ["app/helpers.py:5", "app/queued.py:3"]
    report = staging.report(missing, base=tmp_path)
    assert "zz_made_up_dist" in report and "app/helpers.py:5" in report and "app/queued.py:3" in report
    print(report)
