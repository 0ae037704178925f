"""serving_loader.model's public names stay importable from it, whichever module of the package defines them."""
from serving_loader import model


def test_serving_model_public_names_import_from_model_py():
    from serving_loader.model import NothingToServeError, RollbackError, ServingModel, zero_example  # noqa: F401

    assert set(model.__all__) == {"ServingModel", "NothingToServeError", "RollbackError", "zero_example"}


def test_the_serve_command_is_the_applications_and_serve_the_librarys():
    from evstore_app import serve_cmd
    from serving_loader import server

    assert callable(serve_cmd.run) and callable(server.serve) and not hasattr(server, "cli")
