"""Turning the field manager's Update entry (a child created by POST) into its Apply entry."""

from __future__ import annotations

from epd_operator.managedfields import owned_by_update, upgrade_to_apply

ME = "epd-operator"


def entry(manager: str, operation: str, fields: dict, **extra) -> dict:
    return {
        "manager": manager,
        "operation": operation,
        "apiVersion": "apps/v1",
        "time": "2026-12-01T03:00:00Z",
        "fieldsType": "FieldsV1",
        "fieldsV1": fields,
        **extra,
    }


CREATED = {
    "f:metadata": {"f:labels": {".": {}, "f:a": {}, "f:b": {}}},
    "f:spec": {"f:replicas": {}, "f:template": {"f:spec": {"f:containers": {'k:{"name":"c"}': {"f:image": {}}}}}},
}
STATUS = entry("kube-controller-manager", "Update", {"f:status": {"f:replicas": {}}}, subresource="status")


def test_a_created_childs_update_entry_becomes_the_apply_entry_and_the_rest_is_kept():
    upgraded = upgrade_to_apply([entry(ME, "Update", CREATED), STATUS], ME)
    assert upgraded == [entry(ME, "Apply", CREATED), STATUS]


def test_an_update_entry_is_merged_into_an_existing_apply_entry():
    applied = entry(ME, "Apply", {"f:metadata": {"f:labels": {".": {}, "f:c": {}}}, "f:spec": {"f:serviceName": {}}})
    upgraded = upgrade_to_apply([applied, entry(ME, "Update", CREATED), STATUS], ME)
    assert upgraded == [
        entry(
            ME,
            "Apply",
            {
                "f:metadata": {"f:labels": {".": {}, "f:a": {}, "f:b": {}, "f:c": {}}},
                "f:spec": {
                    "f:serviceName": {},
                    "f:replicas": {},
                    "f:template": {"f:spec": {"f:containers": {'k:{"name":"c"}': {"f:image": {}}}}},
                },
            },
        ),
        STATUS,
    ]


def test_nothing_to_do_without_an_update_entry_of_the_manager_on_the_object_itself():
    # Ours already applied; another manager's update; our own write of a subresource.
    for entries in (
        [entry(ME, "Apply", CREATED), STATUS],
        [entry("kubectl-edit", "Update", CREATED)],
        [entry(ME, "Update", {"f:status": {}}, subresource="status")],
        [],
    ):
        assert upgrade_to_apply(entries, ME) is None
        assert not owned_by_update(entries, ME)  # what the indexes keep: no read before an apply
    assert owned_by_update([entry(ME, "Update", CREATED), STATUS], ME)
