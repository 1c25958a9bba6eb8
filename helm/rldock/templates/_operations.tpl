{{/* Names and rules of the operator's replicas, leader election and metrics (docs/operator.md). */}}

{{/* The leader Lease: leaderElection.leaseName, or the release's full name. */}}
{{- define "rldock.leaseName" -}}
{{- default (include "rldock.fullname" .) .Values.leaderElection.leaseName | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The rules leader election needs in the release namespace. They must equal lease_rules() in
operator/src/rldock/operator/leader.py; tests/unit/helm/test_chart.py compares them.
*/}}
{{- define "rldock.leaseRules" -}}
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [create]
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  resourceNames: [{{ include "rldock.leaseName" . | quote }}]
  verbs: [get, update]
{{- end }}
