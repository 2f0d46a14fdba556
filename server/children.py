"""The children's entry points, by name: the supervisor starts its children (`spawn`) without importing
what they run, so its own start, and with it each child's, does not wait for the frontend's and the
worker's imports (gRPC, numpy, the engines: about 0.4 s of the supervisor's start on a 2-core host).
Each child imports its module itself."""


def frontend(*args) -> None:
    from server.frontend.process import main

    main(*args)


def worker(*args) -> None:
    from server.worker.process import main

    main(*args)
