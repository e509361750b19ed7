"""The one logging setup of eaglet's processes, called once at each entry point; modules below only
``logging.getLogger(__name__)``."""

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format=FORMAT)
