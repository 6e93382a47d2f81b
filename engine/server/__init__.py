"""The OpenAI-compatible local server (``colibri serve``, and "Serve on this computer" in the app).

Floor: above the inference core and the model library, below the benchmarks and the CLI
(docs/architecture.md). Starlette + uvicorn serve the API; one engine answers every client
through a bounded FIFO of jobs. Modules:

    server       ServerOptions (host, port, key, CORS, limits) and LocalServer (uvicorn on a thread)
    gate         Host / Origin / Content-Type checks before any work (no web page drives the server)
    openai_api   the endpoints, OpenAI-shaped responses and errors, the Starlette app
    request_checks  request bodies, fields, sampling and messages checked (both APIs); ApiError
    anthropic_api  POST /v1/messages (Anthropic's Messages API) on the same queue
    tools        tools / tool_choice checks, every family's call format parsed out of answers
    grammar      constrained decoding (llguidance): forced calls, response_format JSON
    jobs         Job, JobQueue (bounded FIFO, one dispatcher), run_job, DirectRunner
    textstream   stop strings and the <think> reasoning split, streamed
    stats        ServerStats and the Prometheus exposition of /metrics

The app uses the names in ``__all__`` (docs/engine-api.md).
"""

from .gate import check_origin_syntax
from .jobs import DirectRunner, Job, JobQueue, JobResult, NoModel, QueueFull, run_job
from .openai_api import ApiError, PendingModel, ServedModel
from .server import DEFAULT_PORT, LocalServer, ServerOptions, is_loopback
from .stats import ServerStats

__all__ = ["DEFAULT_PORT", "LocalServer", "ServerOptions", "ServedModel", "PendingModel", "ServerStats", "is_loopback",
           "Job", "JobQueue", "JobResult", "NoModel", "QueueFull", "DirectRunner", "run_job", "ApiError",
           "check_origin_syntax"]
