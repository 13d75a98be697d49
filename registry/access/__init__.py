"""Registry access: names, the store and its lock, versions resolved to folders, runs found by a param, version and
model pages, the drafterops flavor, a drafter's identity by content.
"""
