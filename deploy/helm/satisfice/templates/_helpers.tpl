{{/* Names, labels and the addresses the gateway's config refers to. */}}

{{- define "satisfice.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "satisfice.fullname" -}}
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

{{- define "satisfice.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "satisfice.selectorLabels" -}}
app.kubernetes.io/name: {{ include "satisfice.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "satisfice.labels" -}}
helm.sh/chart: {{ include "satisfice.chart" . }}
{{ include "satisfice.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The gateway's pods: what its Deployment, Service, PDB and HPA select. */}}
{{- define "satisfice.gatewaySelectorLabels" -}}
{{ include "satisfice.selectorLabels" . }}
app.kubernetes.io/component: gateway
{{- end }}

{{- define "satisfice.gatewayName" -}}
{{- printf "%s-gateway" (include "satisfice.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* (list $ "name") -> the Deployment and Service name of engine "name". */}}
{{- define "satisfice.engineName" -}}
{{- $root := index . 0 }}
{{- printf "%s-engine-%s" (include "satisfice.fullname" $root) (index . 1) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "satisfice.engineSelectorLabels" -}}
{{ include "satisfice.selectorLabels" (index . 0) }}
app.kubernetes.io/component: engine
satisfice/engine: {{ index . 1 }}
{{- end }}

{{/* (list $ "name") -> the OpenAI base URL of engine "name", for the gateway's config. */}}
{{- define "satisfice.engineUrl" -}}
{{- $root := index . 0 }}
{{- $name := index . 1 }}
{{- $engine := index $root.Values.engines $name | default dict }}
{{- if not $engine.enabled }}
{{- fail (printf "config refers to engine %q, which engines.%s does not enable" $name $name) }}
{{- end }}
{{- printf "http://%s:8000/v1" (include "satisfice.engineName" (list $root $name)) }}
{{- end }}

{{/*
The Redis the cache uses: the dependency's primary, named as the Bitnami chart names it
(common.names.fullname + "-master"), or externalRedis.url.
*/}}
{{- define "satisfice.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- $name := default "redis" .Values.redis.nameOverride }}
{{- $release := regexReplaceAll "(-?[^a-z\\d\\-])+-?" (lower .Release.Name) "-" }}
{{- $full := "" }}
{{- if .Values.redis.fullnameOverride }}
{{- $full = .Values.redis.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains $name $release }}
{{- $full = $release | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $full = printf "%s-%s" $release $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- $port := dig "master" "service" "ports" "redis" 6379 .Values.redis }}
{{- printf "redis://%s-master:%v/0" $full $port }}
{{- else }}
{{- required "externalRedis.url is required when redis.enabled is false" .Values.externalRedis.url }}
{{- end }}
{{- end }}

{{- define "satisfice.secretName" -}}
{{- default (include "satisfice.fullname" .) .Values.secrets.existingSecret }}
{{- end }}

{{- define "satisfice.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "satisfice.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The gateway's config file: `config` from the values, its strings rendered as templates. */}}
{{- define "satisfice.config" -}}
{{- tpl (toYaml .Values.config) . }}
{{- end }}
