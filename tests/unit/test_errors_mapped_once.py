"""Errors mapped once: every service's error answers come from the one table in ``clm_http.errors`` (issue #32:
"routes raise typed errors only; one table maps them to status, body type and headers").

The check reads the code (AST, docstrings and comments excluded), so a second mapping is caught wherever it is:

* an error raised with its status written inline (``APIError(404, ...)``, ``HTTPException(status_code=409)``),
  or the base ``APIError`` raised at all (it says nothing about what went wrong; its subclasses do);
* an exception handler registered anywhere but ``clm_http/errors.py`` (``@app.exception_handler(...)``,
  ``app.add_exception_handler(...)``, ``FastAPI(exception_handlers=...)``): a service adds rows to the table
  through ``install_error_handlers(app, answers=...)`` instead.

And the table itself: every typed error has a row, and each is answered in the OpenAI/vLLM body shape.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from clm_devtools.paths import REPO_ROOT

from clm.errors import SATURATED, UNAVAILABLE, KindedError
from clm_http import errors
from clm_http.errors import ERROR_ANSWERS, APIError, answer_for, install_error_handlers

CODE_ROOTS = ("shared/clm", "services", "bench", "scripts", "devtools")
THE_TABLE = REPO_ROOT / "services" / "common" / "clm_http" / "errors.py"
RAISED_WITH_A_STATUS = {"APIError", "HTTPException"}
REGISTRATIONS = {"exception_handler", "add_exception_handler"}


def _sources() -> list[Path]:
    return sorted(path for root in CODE_ROOTS for path in (REPO_ROOT / root).rglob("*.py"))


def _name(func: ast.expr) -> str | None:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def second_mappings(path: Path, source: str) -> list[str]:
    """The error mappings ``source`` (the file at ``path``) makes that only ``clm_http/errors.py`` may."""
    if path == THE_TABLE:
        return []
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        where = f"{path.relative_to(REPO_ROOT) if path.is_absolute() else path}:{node.lineno}"
        name = _name(node.func)
        if name == "APIError":
            found.append(f"{where}: APIError(...) (raise the typed error that says what went wrong: "
                         "clm_http.errors.InvalidRequest, ResourceNotFound, ...)")
        elif name in RAISED_WITH_A_STATUS and (
                any(isinstance(arg, ast.Constant) and isinstance(arg.value, int) for arg in node.args[:1])
                or any(keyword.arg == "status_code" for keyword in node.keywords)):
            found.append(f"{where}: {name} with an inline status (raise a typed error; the table has the status)")
        if name in REGISTRATIONS:
            found.append(f"{where}: {name}(...) (add a row: install_error_handlers(app, answers=...))")
        if any(keyword.arg == "exception_handlers" for keyword in node.keywords):
            found.append(f"{where}: exception_handlers=... (add a row: install_error_handlers(app, answers=...))")
    return sorted(found, key=lambda problem: int(problem.split(":")[1]))  # in line order


def test_errors_are_mapped_once():
    found = [problem for path in _sources() for problem in second_mappings(path, path.read_text())]
    assert found == [], "\n".join(found)


def test_the_check_catches_each_kind_of_second_mapping():
    """The check can fail: each kind of second mapping, written in a route module."""
    copy = '''
"""A docstring may say APIError(404, ...)."""
from fastapi import FastAPI, HTTPException
app = FastAPI(exception_handlers={KeyError: None})
def route():
    raise APIError(404, "no job")
def other():
    raise HTTPException(status_code=409, detail="taken")
@app.exception_handler(ValueError)
async def handler(request, exc):
    return None
app.add_exception_handler(KeyError, handler)
'''
    problems = second_mappings(Path("services/trainer/clm_trainer/copy.py"), copy)
    assert [problem.split(": ", 1)[1].split(" (")[0] for problem in problems] == [
        "exception_handlers=...", "APIError(...)", "HTTPException with an inline status", "exception_handler(...)",
        "add_exception_handler(...)"], problems


def _typed_errors() -> list[type[APIError]]:
    found, todo = [], [APIError]
    while todo:
        cls = todo.pop()
        found += cls.__subclasses__()
        todo += cls.__subclasses__()
    return found


def test_every_typed_error_has_a_row():
    assert {cls for cls in vars(errors).values() if isinstance(cls, type) and issubclass(cls, APIError)} - {
        APIError} == set(ERROR_ANSWERS)
    assert all(answer_for(cls("x")) is not None for cls in _typed_errors())


class Outage(KindedError):
    kind = UNAVAILABLE
    subject = "the encoder"


class Busy(KindedError):
    kind = SATURATED


class OwnError(Exception):
    param = "thing"


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()
    install_error_handlers(app, retry_after_s=7, answers={OwnError: errors.answered_as(errors.Conflict)})
    raised = {cls.__name__: cls("it went wrong", param="field") for cls in ERROR_ANSWERS
              if cls is not errors.ServiceUnavailable}
    raised |= {"ServiceUnavailable": errors.ServiceUnavailable("later"),
               "OwnRetry": errors.ServiceUnavailable("later", retry_after_s=3),
               "Outage": Outage("connection refused"), "Busy": Busy("64 in flight"),
               "OwnError": OwnError("mine"), "Bug": KeyError("epoch")}

    @app.get("/raise/{name}")
    async def route(name: str, number: int = 0):
        raise raised[name]

    return TestClient(app, raise_server_exceptions=False)


@pytest.mark.parametrize(("name", "status", "error_type", "param", "headers"), [
    ("InvalidRequest", 400, "BadRequestError", "field", {}),
    ("MalformedRequest", 400, "Bad Request", "field", {}),
    ("Unauthorized", 401, "AuthenticationError", "field", {"www-authenticate": "Bearer"}),
    ("Forbidden", 403, "PermissionDeniedError", "field", {}),
    ("ResourceNotFound", 404, "NotFoundError", "field", {}),
    ("MethodNotAllowed", 405, "MethodNotAllowed", "field", {}),
    ("Conflict", 409, "ConflictError", "field", {}),
    ("PayloadTooLarge", 413, "RequestTooLarge", "field", {}),
    ("NotSupported", 501, "NotImplementedError", "field", {}),
    ("ServiceUnavailable", 503, "ServiceUnavailableError", None, {"retry-after": "7"}),
    ("OwnRetry", 503, "ServiceUnavailableError", None, {"retry-after": "3"}),
    ("Outage", 503, "ServiceUnavailableError", None, {"retry-after": "7"}),
    ("Busy", 503, "ServiceUnavailableError", None, {"retry-after": "7"}),
    ("OwnError", 409, "ConflictError", "thing", {}),
    ("Bug", 500, "InternalServerError", None, {}),
])
def test_each_row_answers_in_the_openai_body_shape(client, name, status, error_type, param, headers):
    response = client.get(f"/raise/{name}")
    assert response.status_code == status
    assert response.json() == {"error": {"message": response.json()["error"]["message"], "type": error_type,
                                         "param": param, "code": status}}
    assert {key: response.headers.get(key) for key in headers} == headers
    assert ("retry-after" in response.headers) == (status == 503)
    if name == "Bug":
        assert response.json()["error"]["message"] == "internal error (KeyError); see the service log"
    if name == "Outage":
        assert response.json()["error"]["message"] == "the encoder is unavailable: connection refused; retry later"


def test_starlettes_own_refusals_and_validation_go_through_the_table(client):
    missing = client.get("/nowhere")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
    wrong_method = client.post("/raise/Bug")
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "GET"
    assert wrong_method.json()["error"]["type"] == "MethodNotAllowed"
    invalid = client.get("/raise/InvalidRequest", params={"number": "many"})
    assert invalid.status_code == 400 and invalid.json()["error"]["type"] == "BadRequestError"
    assert invalid.json()["error"]["param"] == "query.number"
