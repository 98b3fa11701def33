{{/* Name of the chart, overridable. */}}
{{- define "epd-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: <release>-<chart> unless the release name already contains the chart name.
Truncated to 63 characters because some Kubernetes name fields are limited to that.
*/}}
{{- define "epd-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "epd-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object of the release. */}}
{{- define "epd-operator.labels" -}}
helm.sh/chart: {{ include "epd-operator.chart" . }}
{{ include "epd-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: epd-operator
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The subset that selects the operator's pods; it must never change between upgrades. */}}
{{- define "epd-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "epd-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "epd-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "epd-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "epd-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/*
Cluster-scoped objects (ClusterRole, ClusterRoleBinding) are shared by every namespace, so
their names carry the release namespace: two releases of the same name in different
namespaces must not take over each other's.
*/}}
{{- define "epd-operator.clusterName" -}}
{{- printf "%s-%s" .Release.Namespace (include "epd-operator.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Checks no schema can express, run by every template that includes them.
*/}}
{{- define "epd-operator.validate" -}}
{{- if gt (int .Values.replicaCount) 1 }}
{{- if not .Values.peering.enabled }}
{{- fail "replicaCount > 1 needs peering.enabled=true: without peering every replica would reconcile the same objects" }}
{{- end }}
{{- end }}
{{- if and .Values.metrics.serviceMonitor.enabled (not .Values.metrics.enabled) }}
{{- fail "metrics.serviceMonitor.enabled needs metrics.enabled=true" }}
{{- end }}
{{- end }}

{{/* The operator's command line (after the `epd-operator` entrypoint). */}}
{{- define "epd-operator.args" -}}
- run
{{- if .Values.watchNamespaces }}
{{- range .Values.watchNamespaces }}
- --namespace={{ . }}
{{- end }}
{{- else }}
- --all-namespaces
{{- end }}
{{- if .Values.peering.enabled }}
- --peering={{ .Values.peering.name }}
{{- /* Distinct priorities make one replica the leader and the others stand by (kopf pauses all
peers that share the top priority). */}}
- --priority=random
{{- else }}
- --standalone
{{- end }}
- --liveness=http://0.0.0.0:{{ .Values.health.port }}/healthz
- --metrics-port={{ if .Values.metrics.enabled }}{{ .Values.metrics.port }}{{ else }}0{{ end }}
- --log-level={{ .Values.logLevel }}
- --log-format={{ .Values.logFormat }}
- --janitor-scrape-interval={{ .Values.janitorScrape.interval }}
- --janitor-scrape-rate={{ .Values.janitorScrape.rate }}
{{- end }}

{{/* The PodMonitor's labels of every EPD series, from its pod (resources.py labels every pod; a pool's and a gateway's name their model in a label of their own). */}}
{{- define "epd-operator.podTargetRelabelings" -}}
- sourceLabels: [__meta_kubernetes_pod_label_epd_vime_dev_role]
  targetLabel: role
- sourceLabels: [__meta_kubernetes_pod_label_epd_vime_dev_deployment]
  targetLabel: deployment
- sourceLabels: [__meta_kubernetes_pod_label_epd_vime_dev_model]
  targetLabel: model
- sourceLabels: [__meta_kubernetes_pod_label_epd_vime_dev_gateway]
  regex: (.+)
  targetLabel: model
- sourceLabels: [__meta_kubernetes_pod_label_epd_vime_dev_encoder_pool]
  regex: (.+)
  targetLabel: model
{{- end }}
