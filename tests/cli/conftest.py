"""The fixtures the command tests share with the tests of the packages the commands drive."""

from tests.align.conftest import _tiny_models_one_thread, tiny_policy, tiny_tokenizer  # noqa: F401
from tests.data.conftest import http_server  # noqa: F401
from tests.tokenizer.conftest import tinystories_text  # noqa: F401
