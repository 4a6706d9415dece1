{{/*
Names and labels shared by every template.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "rlhf-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every object name: fullnameOverride, else the release name when it already contains
the chart name, else "<release>-<chart>". Truncated to 63 characters (the DNS label limit).
*/}}
{{- define "rlhf-operator.fullname" -}}
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

{{/*
Name of cluster-scoped objects (ClusterRoles, ClusterRoleBindings): the release namespace is part of
it, so the same release name in two namespaces does not collide.
*/}}
{{- define "rlhf-operator.clusterName" -}}
{{- printf "%s-%s" .Release.Namespace (include "rlhf-operator.fullname" .) | trunc 253 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "rlhf-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "rlhf-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rlhf-operator
{{- end }}

{{/* Labels that select the operator pod; they never change across upgrades. */}}
{{- define "rlhf-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rlhf-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The ServiceAccount the operator runs as. */}}
{{- define "rlhf-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rlhf-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator image: repository@digest when a digest is set, else repository:tag. */}}
{{- define "rlhf-operator.trainerImage" -}}
{{- $img := .Values.jobDefaults.trainerImage -}}
{{- printf "%s:%s" $img.repository (default .Chart.AppVersion $img.tag) }}
{{- end }}

{{- define "rlhf-operator.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Name of the operator's metrics Service; Prometheus uses it as the `job` label of the scrape. */}}
{{- define "rlhf-operator.metricsServiceName" -}}
{{- printf "%s-metrics" (include "rlhf-operator.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* True (non-empty) when the cluster serves the Prometheus Operator's monitoring.coreos.com/v1 API. */}}
{{- define "rlhf-operator.hasPrometheusOperator" -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" }}true{{ end }}
{{- end }}

{{/*
The rules the operator needs in every namespace it watches. Used by the ClusterRole in cluster-wide
mode and by the Role in each watched namespace otherwise. Each rule says why the operator needs it.
*/}}
{{- define "rlhf-operator.namespacedRules" -}}
# RLHFJobs: kopf lists and watches them and patches its finalizer and progress annotations; the
# autoscaler writes spec.rollout.engines on the object itself (the /scale subresource is for
# HPA/KEDA, which carry their own RBAC; the operator never calls it); delete is for
# runPolicy.ttlSecondsAfterFinished.
- apiGroups: ["rlhf.dev"]
  resources: ["rlhfjobs"]
  verbs: ["get", "list", "watch", "patch", "update", "delete"]
# The status the operator reports (phase, step, timings, engines, conditions).
- apiGroups: ["rlhf.dev"]
  resources: ["rlhfjobs/status"]
  verbs: ["get", "patch", "update"]
# kopf.adopt() sets blockOwnerDeletion on the RayCluster's owner reference; clusters that enforce
# owner-reference permissions (OwnerReferencesPermissionEnforcement) require this to allow it.
- apiGroups: ["rlhf.dev"]
  resources: ["rlhfjobs/finalizers"]
  verbs: ["update"]
# The RayCluster each RLHFJob owns: created, scaled (worker group replicas), deleted on restart.
- apiGroups: ["ray.io"]
  resources: ["rayclusters"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["ray.io"]
  resources: ["rayclusters/status"]
  verbs: ["get"]
# Kueue's Workload of a queued RayCluster, read for the reason it waits (docs/kueue.md). Never written.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["get", "list"]
# Each job's Ray token Secret and NetworkPolicy (docs/security.md): created, owned by the job, removed
# by garbage collection. Create only: the operator derives every token from its own key and never
# reads, lists or changes a Secret. RBAC cannot narrow `create` by name (resourceNames does not apply).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["create"]
# A job's RLHFRuntime (spec.runtimeRef in its own namespace), read by name once, when the job is bound
# to it (docs/runtimes.md). Never listed or watched: editing a runtime changes no running job.
- apiGroups: ["rlhf.dev"]
  resources: ["rlhfruntimes"]
  verbs: ["get"]
# The ConfigMaps the operator makes, each owned by its job: <job>-stacks, a stalled job's stack snapshot
# (docs/monitoring.md; create, then replace on the next stall), and <job>-runtime, the job's immutable
# copy of its runtime (created once, read back by name after an operator restart). `get` cannot be
# narrowed to these names (they are per job), so it covers every ConfigMap here; none is listed or watched.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "update"]
# The checkpoint claim <job>-checkpoints that a runtime's claimTemplate asks for, created once per job.
# Never read, changed or deleted: the job owns it (whenJobDeleted: Delete) or the next job of its name
# takes it over (Retain).
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["create"]
# Read-only: head pod readiness, and the head Service that carries the Ray dashboard and metrics ports.
- apiGroups: [""]
  resources: ["pods", "services"]
  verbs: ["get", "list", "watch"]
# The head's fetch-models init container's log, read while it runs: the bytes of the ModelsReady condition
# (docs/models.md). Only the last lines of that one container.
- apiGroups: [""]
  resources: ["pods/log"]
  verbs: ["get"]
# Events on RLHFJobs (scale decisions, stalls, restarts); kopf posts through the core API, newer
# clients through events.k8s.io.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}

{{/*
The cluster-scoped rules the operator needs in both modes (no Role can grant a cluster-scoped resource):
in the one ClusterRole cluster-wide, in the small ClusterRole beside the Roles otherwise.
*/}}
{{- define "rlhf-operator.clusterScopedRules" -}}
# kopf watches CRDs to notice the RLHFJob resource appearing or changing.
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
# A job's ClusterRLHFRuntime (spec.runtimeRef), read by name once, when the job is bound to it. Never
# listed or watched, for the same reason as rlhfruntimes.
- apiGroups: ["rlhf.dev"]
  resources: ["clusterrlhfruntimes"]
  verbs: ["get"]
{{- end }}
