"""Old import paths (`offline_rec.data.dataset`, `.card`, `.validate`), kept for one release: the data layer was
split by job into offline_rec/dataset/, importers/, view/, rewards/ and training/ (docs/architecture.md)."""
