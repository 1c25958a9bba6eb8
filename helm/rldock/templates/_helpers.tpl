{{/* Names, labels and shared fragments of the rldock chart. */}}

{{- define "rldock.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's full name: object names of the chart (Deployment, ServiceAccount, (Cluster)Role). */}}
{{- define "rldock.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "rldock.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rldock.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "rldock.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "rldock.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rldock
{{- end }}

{{/* The selector labels as `k=v,k=v`, how the operator learns its own pods' labels. */}}
{{- define "rldock.selectorLabelList" -}}
{{- $pairs := list }}
{{- range $key, $value := (include "rldock.selectorLabels" . | fromYaml) }}
{{- $pairs = append $pairs (printf "%s=%s" $key $value) }}
{{- end }}
{{- join "," (sortAlpha $pairs) }}
{{- end }}

{{/* The Secret holding the key the RLJobs' Ray tokens are derived from: the admin's own
(tokenKey.existingSecret), or the one the chart makes. */}}
{{- define "rldock.tokenKeySecret" -}}
{{- default (printf "%s-token-key" (include "rldock.fullname" .)) .Values.tokenKey.existingSecret }}
{{- end }}

{{- define "rldock.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rldock.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* repository:tag, the tag defaulting to the chart's appVersion. Argument: (list $image $) */}}
{{- define "rldock.image" -}}
{{- $image := index . 0 }}
{{- $root := index . 1 }}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) }}
{{- end }}

{{/*
The operator's RBAC rules. They must equal RULES in operator/src/rldock/operator/builders/rbac.py, which says why each
one is there; tests/unit/helm/test_chart.py compares the rendered rules with it.
*/}}
{{- define "rldock.rbacRules" -}}
- apiGroups: [rldock.io]
  resources: [rljobs]
  verbs: [list, watch, patch, delete]
- apiGroups: [rldock.io]
  resources: [rljobs/status]
  verbs: [patch]
- apiGroups: [rldock.io]
  resources: [rljobs/finalizers]
  verbs: [update]
- apiGroups: [ray.io]
  resources: [rayclusters]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, create]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [get, create, patch, delete]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
- apiGroups: [authorization.k8s.io]
  resources: [localsubjectaccessreviews]
  verbs: [create]
{{- end }}
