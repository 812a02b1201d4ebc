#!/usr/bin/env bash
# The released chart's addresses, written into a copy of charts/canaryd (make dist; tests/
# test_release.py): usage stamp-chart.sh CHART_DIR ORG VERSION IMAGE. Its home and sources,
# its default image, and its alerts' runbook: the repository's docs at the tag vVERSION.
set -euo pipefail
chart=$1 org=$2 version=$3 image=$4
sed -i "s|github.com/ORG/canaryd|github.com/$org/canaryd|g" "$chart/Chart.yaml"
sed -i -e "s|^  repository: canaryd$|  repository: $image|" \
	-e "s|^  runbookBaseURL: .*$|  runbookBaseURL: https://github.com/$org/canaryd/blob/v$version|" \
	"$chart/values.yaml"
