"""serving_loader.model's public names stay importable from it, whichever module of the package defines them."""
from serving_loader import model


def test_serving_model_public_names_import_from_model_py():
    from serving_loader.model import NothingToServeError, RollbackError, ServingModel, zero_example  # noqa: F401

    assert set(model.__all__) == {"ServingModel", "NothingToServeError", "NotAnExportError", "RollbackError",
                                  "zero_example"}


def test_the_serve_command_is_the_applications_and_serve_the_librarys():
    from evstore_app import serve_cmd
    from serving_loader import server

    assert callable(serve_cmd.run) and callable(server.serve) and not hasattr(server, "cli")


def test_both_served_table_kinds_implement_every_method_of_their_interface():
    from serving_loader.ev_table import EvTable
    from serving_loader.served_table import ReplaceableTable, ServedTable
    from serving_loader.table import Table

    for kind, interface in ((Table, ServedTable), (EvTable, ReplaceableTable)):
        assert interface in kind.__mro__   # declared, not only alike
        for name in ("size", "insert", "erase", "warm", "close") + (("replacement", "adopt", "stats")
                                                                     if interface is ReplaceableTable else ()):
            assert getattr(kind, name) is not getattr(interface, name), f"{kind.__name__}.{name} is the interface's stub"
        assert isinstance(kind.reserves_sentinels, bool) and isinstance(kind.weighs_freqs, bool)
