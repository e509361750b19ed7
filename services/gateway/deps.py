"""What routes depend on: settings, the Redis connection, the bearer token, a checked run id."""

import hmac
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from redis import Redis

from eaglet.services.gateway.settings import GatewaySettings
from eaglet.shared.alerts import StatusConfig
from eaglet.shared.ids import UnsafeName, check_id
from eaglet.shared.status import disk_usage

bearer = HTTPBearer(auto_error=False, description="EAGLET_API_TOKEN")


def get_settings(request: Request) -> GatewaySettings:
    return request.app.state.settings


def get_redis(request: Request) -> Redis:
    return request.app.state.redis


def get_queue_redis(request: Request) -> Redis:
    """RQ's connection: replies stay bytes, as RQ's pickled jobs need."""
    return request.app.state.queue_redis


def get_status_config(request: Request) -> StatusConfig:
    return request.app.state.status_config


SettingsDep = Annotated[GatewaySettings, Depends(get_settings)]
RedisDep = Annotated[Redis, Depends(get_redis)]
QueueRedisDep = Annotated[Redis, Depends(get_queue_redis)]
StatusConfigDep = Annotated[StatusConfig, Depends(get_status_config)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


def require_token(settings: SettingsDep, credentials: Credentials) -> None:
    """Run control needs ``Authorization: Bearer <EAGLET_API_TOKEN>``; compared in constant time."""
    if not settings.api_token:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "run control is disabled: set EAGLET_API_TOKEN on the gateway")
    given = credentials.credentials.encode() if credentials else b""
    if not hmac.compare_digest(given, settings.api_token.encode()):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing or wrong bearer token",
            headers={"WWW-Authenticate": "Bearer"},
        )


def require_read_access(settings: SettingsDep, credentials: Credentials) -> None:
    """GETs are open unless EAGLET_READ_REQUIRES_TOKEN is set."""
    if settings.read_requires_token:
        require_token(settings, credentials)


def checked_run_id(run_id: Annotated[str, Path(description="1-128 of [A-Za-z0-9._-]")]) -> str:
    try:
        return check_id(run_id, "run id")
    except UnsafeName as e:
        raise RequestValidationError([{"type": "value_error", "loc": ("path", "run_id"), "msg": str(e)}]) from e


def local_disk(settings: SettingsDep) -> tuple[int, int] | None:
    """The data volume as this gateway sees it (it need not mount it); workers' own figures come first."""
    return disk_usage(settings.data_dir)


RunIdDep = Annotated[str, Depends(checked_run_id)]
LocalDiskDep = Annotated[tuple[int, int] | None, Depends(local_disk)]
TokenDep = Depends(require_token)
ReadAccessDep = Depends(require_read_access)
