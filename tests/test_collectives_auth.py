"""The job secret (``elastix._auth.load_secret``): from a private file, or (with a warning) from
the environment; a file others can read or write is refused, and the secret never appears in a
message."""

from __future__ import annotations

import warnings

import pytest

from elastix import _auth
from elastix._auth import FILE_ENV, TOKEN_ENV, load_secret

SECRET = "correct horse battery staple"


def write_secret(tmp_path, text: str = SECRET, mode: int = 0o600, name: str = "token") -> str:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(mode)
    return str(path)


@pytest.fixture
def env(monkeypatch):
    """No secret unless a test sets one."""
    monkeypatch.delenv(FILE_ENV, raising=False)
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    return monkeypatch


# -- the secret ----------------------------------------------------------------------------------


def test_secret_from_a_private_file_is_stripped(tmp_path, env):
    env.setenv(FILE_ENV, write_secret(tmp_path, SECRET + " \n\n"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a file is the recommended way: no warning
        assert load_secret() == SECRET.encode()


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o620, 0o602, 0o700 | 0o044])
def test_secret_file_others_may_read_or_write_is_refused(tmp_path, env, mode):
    path = write_secret(tmp_path, mode=mode)
    env.setenv(FILE_ENV, path)
    with pytest.raises(PermissionError) as info:
        load_secret()
    message = str(info.value)
    assert "chmod 600" in message and path in message and f"{mode & 0o777:04o}" in message
    assert SECRET not in message and "horse" not in message
    assert SECRET not in repr(info.value)


def test_no_secret_is_none(env):
    assert load_secret() is None


def test_empty_or_missing_secrets_are_errors(tmp_path, env):
    env.setenv(FILE_ENV, write_secret(tmp_path, " \n\n"))
    with pytest.raises(ValueError, match="empty"):
        load_secret()
    env.setenv(FILE_ENV, "")
    with pytest.raises(ValueError, match="set but empty"):
        load_secret()
    missing = str(tmp_path / "absent")
    env.setenv(FILE_ENV, missing)
    with pytest.raises(FileNotFoundError, match=FILE_ENV) as info:
        load_secret()
    assert missing in str(info.value)
    env.delenv(FILE_ENV)
    env.setenv(TOKEN_ENV, "")
    with pytest.raises(ValueError, match="set but empty"):
        load_secret()


def test_secret_from_the_environment_works_with_a_warning(env):
    env.setenv(TOKEN_ENV, SECRET)
    with pytest.warns(UserWarning, match="environment variables leak") as record:
        assert load_secret() == SECRET.encode()
    assert all(SECRET not in str(w.message) for w in record)


def test_secret_file_wins_over_the_environment(tmp_path, env):
    env.setenv(FILE_ENV, write_secret(tmp_path, "from the file"))
    env.setenv(TOKEN_ENV, SECRET)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_secret() == b"from the file"


def test_secret_module_names_no_secret_in_its_repr():
    assert SECRET not in repr(_auth)
