import json

import pytest

from logitless.cli import main


def test_bench_lmhead_small_shape(tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    assert main(["bench", "lmhead", "-B", "2", "-T", "16", "-H", "8", "-V", "1009", "--repeats", "1",
                 "--impl", "materialized", "liger", "logitless", "--json", str(out_json), "--plot", str(out_png)]) == 0
    report = json.loads(out_json.read_text())
    assert report["shape"] == {"batch": 2, "seq": 16, "hidden": 8, "vocab": 1009, "dtype": "float32", "device": "cpu"}
    assert set(report["results"]) == {"materialized", "liger", "logitless"}
    for name, result in report["results"].items():
        assert {"time_s", "peak_mb", "loss", "max_abs_grad_diff"} <= result.keys()
        assert result["time_s"] > 0
        assert result["loss_diff"] < 1e-5 and result["max_abs_grad_diff"] < 1e-5, name
    assert report["results"]["materialized"]["max_abs_grad_diff"] == 0.0
    assert out_png.stat().st_size > 5000
    assert "logitless" in capsys.readouterr().out


@pytest.mark.parametrize("argv, match", [
    (["--dtype", "float16"], "--dtype"),
    (["--impl", "mine"], "--impl"),
    (["-B", "0"], "--batch"),
    (["--device", "cuda"], "--device: CUDA"),
])
def test_bench_bad_options(argv, match):
    with pytest.raises(SystemExit, match=match):
        main(["bench", "lmhead", *argv])
