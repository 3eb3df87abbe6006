"""The crossflowctl context ``crossflow demo`` writes for its broker, and takes out at exit."""

from __future__ import annotations

from pathlib import Path

from crossflow_ctl.cli.config import Context, CtlConfig, DemoContext, load_config, save_config


def test_a_first_demo_makes_its_context_current_and_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    demo = DemoContext(path)
    assert demo.write("127.0.0.1:4242") == "crossflowctl get nodes -w"
    config = load_config(path)
    assert config.current_context == "demo"
    assert config.context()[1].server == "127.0.0.1:4242"
    demo.remove()
    assert not path.exists()


def test_a_users_config_keeps_its_current_context_and_gets_back_as_it_was(
    tmp_path: Path,
) -> None:
    path = tmp_path / "config.yaml"
    mine = CtlConfig(current_context="prod", contexts={"prod": Context(server="broker:50051")})
    save_config(path, mine)
    before = path.read_text()
    demo = DemoContext(path)
    assert demo.write("127.0.0.1:4242") == "crossflowctl --context demo get nodes -w"
    config = load_config(path)
    assert config.current_context == "prod" and config.context("demo")[1].server.endswith(":4242")
    demo.remove()
    assert path.read_text() == before


def test_a_context_another_demo_took_over_is_left_to_it(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    first, second = DemoContext(path), DemoContext(path)
    first.write("127.0.0.1:1111")
    second.write("127.0.0.1:2222")
    first.remove()  # the context is the second demo's now
    assert load_config(path).context("demo")[1].server == "127.0.0.1:2222"
    second.remove()
    assert "demo" not in load_config(path).contexts
